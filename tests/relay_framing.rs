//! Black-box tests of RFC 6455 framing on the real binary (SPEC §11 "Framing"): every rule a
//! client can break fails its leg with 1002 (1009 for size) and the pair with 4408; legal
//! frames, cut at any read boundary and with pings between fragments, pass unchanged.
//!
//! The splice legs here are raw sockets that build their own frames (masked or not, as a
//! case needs) and read the relay's frames byte by byte, so nothing in between forgives or
//! reassembles anything. `ORCA_RELAY_FRAMING_BINARY=/path/to/orca-relay` runs the same tests
//! against another build (how the "failed before" list in the change notes was made).

mod harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use harness::*;

fn start_relay() -> Relay {
    let dir = Arc::new(TempDir::new("framing"));
    match std::env::var_os("ORCA_RELAY_FRAMING_BINARY") {
        Some(binary) => Relay::start_binary(std::path::Path::new(&binary), dir, &[]),
        None => Relay::start_in(dir, &[]),
    }
}

/// A deterministic generator (SplitMix64): the same seed, the same test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// A masked client frame, built here independently of the relay's own code.
fn client_frame(first: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
    let mut out = vec![first];
    match payload.len() {
        len @ 0..=125 => out.push(0x80 | len as u8),
        len @ 126..=65_535 => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        len => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
}

/// One end of a splice as a raw socket.
struct RawLeg {
    stream: TcpStream,
}

/// A frame the relay sent: (first header byte, payload).
type ServerFrame = (u8, Vec<u8>);

impl RawLeg {
    /// Upgrades `path` and returns the socket right after the 101 head.
    fn upgrade(relay: &Relay, path: &str) -> RawLeg {
        let mut stream = TcpStream::connect(&relay.ws).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream
            .write_all(
                format!(
                    "GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
                )
                .as_bytes(),
            )
            .unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert!(head.len() < 4096, "response head too long");
            stream.read_exact(&mut byte).unwrap();
            head.push(byte[0]);
        }
        assert!(
            head.starts_with(b"HTTP/1.1 101"),
            "{}",
            String::from_utf8_lossy(&head)
        );
        RawLeg { stream }
    }

    fn send(&mut self, first: u8, payload: &[u8]) {
        self.send_raw(&client_frame(first, payload, [0x5a, 0x01, 0xc3, 0x7e]));
    }

    fn send_json(&mut self, value: serde_json::Value) {
        self.send(0x81, value.to_string().as_bytes());
    }

    fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    /// The next frame from the relay; `None` when the connection ends first.
    fn read_frame(&mut self) -> Option<ServerFrame> {
        let mut head = [0u8; 2];
        self.stream.read_exact(&mut head).ok()?;
        assert_eq!(head[1] & 0x80, 0, "server frames are never masked");
        let len = match head[1] & 0x7f {
            126 => {
                let mut ext = [0u8; 2];
                self.stream.read_exact(&mut ext).ok()?;
                u16::from_be_bytes(ext) as usize
            }
            127 => {
                let mut ext = [0u8; 8];
                self.stream.read_exact(&mut ext).ok()?;
                u64::from_be_bytes(ext) as usize
            }
            short => short as usize,
        };
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload).ok()?;
        Some((head[0], payload))
    }

    /// Reads up to the relay's close frame. Returns the frames before it and its code
    /// (`Some(None)`: a close without a code; `None`: the connection ended without one).
    fn read_until_close(&mut self) -> (Vec<ServerFrame>, Option<Option<u16>>) {
        let mut before = Vec::new();
        while let Some((first, payload)) = self.read_frame() {
            if first & 0x0f == 0x8 {
                let code =
                    (payload.len() >= 2).then(|| u16::from_be_bytes([payload[0], payload[1]]));
                return (before, Some(code));
            }
            before.push((first, payload));
        }
        (before, None)
    }
}

/// A phone and a data leg of `desktop`, both raw, spliced and past `relay-hello`.
fn raw_splice(relay: &Relay, desktop: &mut Desktop) -> (RawLeg, RawLeg) {
    let invite = desktop.invite();
    let mut phone = RawLeg::upgrade(relay, &format!("/v1/connect/{}", desktop.relay_host_id));
    phone.send_json(serde_json::json!({"type":"relay-auth","v":1,"credential":invite}));
    let (conn_id, ticket) = desktop.conn_open();
    let mut leg = RawLeg::upgrade(relay, &format!("/v1/host/data/{conn_id}"));
    leg.send_json(serde_json::json!({"type":"host-data-auth","v":1,"connTicket":ticket,"generation":desktop.generation}));
    let (first, hello) = phone.read_frame().expect("relay-hello");
    assert_eq!(first, 0x81);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&hello).unwrap(),
        serde_json::json!({"type":"relay-hello","ok":true})
    );
    (phone, leg)
}

#[test]
fn each_framing_rule_fails_the_leg_with_its_code_and_the_pair_with_4408() {
    let relay = start_relay();
    let mut desktop = Desktop::connect(&relay);
    let mask = [9, 8, 7, 6];
    let open = client_frame(0x01, b"open", mask); // a text message left open
    let mut high_bit = vec![0x82, 0xff, 0x80, 0, 0, 0, 0, 0, 0, 0];
    high_bit.extend_from_slice(&mask);
    let mut over_8_mib = vec![0x82, 0xff];
    over_8_mib.extend_from_slice(&(8u64 * 1024 * 1024 + 1).to_be_bytes());
    over_8_mib.extend_from_slice(&mask);
    let half = 4 * 1024 * 1024;
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("unmasked", vec![0x82, 0x03, 1, 2, 3], 1002),
        ("rsv1", client_frame(0xc2, b"x", mask), 1002),
        ("rsv2", client_frame(0xa2, b"x", mask), 1002),
        ("rsv3", client_frame(0x92, b"x", mask), 1002),
        (
            "reserved data opcode 3",
            client_frame(0x83, b"x", mask),
            1002,
        ),
        (
            "reserved control opcode 11",
            client_frame(0x8b, b"", mask),
            1002,
        ),
        (
            "ping of 126 bytes",
            client_frame(0x89, &[0; 126], mask),
            1002,
        ),
        ("ping without FIN", client_frame(0x09, b"p", mask), 1002),
        (
            "continuation with no message open",
            client_frame(0x80, b"orphan", mask),
            1002,
        ),
        (
            "text frame while a message is open",
            [open.clone(), client_frame(0x81, b"new", mask)].concat(),
            1002,
        ),
        (
            "binary frame while a message is open",
            [open.clone(), client_frame(0x82, b"new", mask)].concat(),
            1002,
        ),
        ("64-bit length with the high bit set", high_bit, 1002),
        ("one frame over 8 MiB (header only)", over_8_mib, 1009),
        (
            "a message over 8 MiB in two fragments",
            [
                client_frame(0x02, &vec![1; half], mask),
                client_frame(0x80, &vec![2; half + 1], mask),
            ]
            .concat(),
            1009,
        ),
        (
            "close with a 1-byte payload",
            client_frame(0x88, &[3], mask),
            1002,
        ),
        (
            "close with code 1005 (never sent)",
            client_frame(0x88, &1005u16.to_be_bytes(), mask),
            1002,
        ),
        (
            "close with code 999",
            client_frame(0x88, &999u16.to_be_bytes(), mask),
            1002,
        ),
        (
            "close with a reason that is not UTF-8",
            client_frame(0x88, &[0x03, 0xe8, 0xc3, 0x28], mask),
            1002,
        ),
    ];
    let mut failures = Vec::new();
    for (name, bytes, code) in &cases {
        let (mut phone, mut leg) = raw_splice(&relay, &mut desktop);
        phone.send_raw(bytes);
        let (phone_frames, phone_close) = phone.read_until_close();
        let (leg_frames, leg_close) = leg.read_until_close();
        // Only the first fragment of the "open" cases may have reached the data leg.
        let forwarded_ok = leg_frames.iter().all(|(first, payload)| {
            *first == 0x01 && payload == b"open" || *first == 0x02 && payload.len() == half
        });
        if phone_close != Some(Some(*code)) || leg_close != Some(Some(4408)) || !forwarded_ok {
            failures.push(format!(
                "{name}: phone close {phone_close:?} (want {code}), data leg close {leg_close:?} (want 4408), forwarded {:?}, phone saw {} frames",
                leg_frames.iter().map(|(f, p)| (*f, p.len())).collect::<Vec<_>>(),
                phone_frames.len()
            ));
        }
    }
    // The same rules hold from the desktop's side of the splice.
    for (name, bytes, code) in [&cases[0], &cases[8], &cases[9], &cases[14]] {
        let (mut phone, mut leg) = raw_splice(&relay, &mut desktop);
        leg.send_raw(bytes);
        let (_, leg_close) = leg.read_until_close();
        let (_, phone_close) = phone.read_until_close();
        if leg_close != Some(Some(*code)) || phone_close != Some(Some(4408)) {
            failures.push(format!(
                "data leg {name}: leg close {leg_close:?} (want {code}), phone close {phone_close:?} (want 4408)"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The relay still serves: a fresh splice carries data.
    let (mut phone, mut leg) = raw_splice(&relay, &mut desktop);
    phone.send(0x82, b"still here");
    assert_eq!(leg.read_frame(), Some((0x82, b"still here".to_vec())));
}

/// A message split into frames: (first header byte, payload) per frame, pings between
/// fragments, and what the other side must see (the data frames only).
fn random_traffic(rng: &mut Rng, messages: usize) -> (Vec<(u8, Vec<u8>)>, Vec<ServerFrame>) {
    let mut frames = Vec::new();
    let mut expected = Vec::new();
    for _ in 0..messages {
        let text = rng.below(2) == 0;
        let size = match rng.below(10) {
            0 => 0,
            1..=6 => rng.below(200),
            7 | 8 => rng.below(70_000),
            _ => rng.below(600_000),
        };
        let payload = if text {
            // Valid UTF-8 as a whole, cut at any byte below (fragments need not be).
            let chars = ['a', 'é', '€', '𝄞', ' '];
            let mut s = String::new();
            while s.len() < size {
                s.push(chars[rng.below(chars.len())]);
            }
            s.into_bytes()
        } else {
            rng.bytes(size)
        };
        let pieces = 1 + rng.below(4);
        let mut cuts: Vec<usize> = (1..pieces).map(|_| rng.below(payload.len() + 1)).collect();
        cuts.sort_unstable();
        cuts.push(payload.len());
        let mut from = 0;
        for (i, to) in cuts.iter().enumerate() {
            let fin = i + 1 == cuts.len();
            let opcode = match (i, text) {
                (0, true) => 0x1,
                (0, false) => 0x2,
                _ => 0x0,
            };
            let first = opcode | if fin { 0x80 } else { 0 };
            frames.push((first, payload[from..*to].to_vec()));
            expected.push((first, payload[from..*to].to_vec()));
            from = *to;
            if !fin && rng.below(2) == 0 {
                let len = rng.below(126);
                let ping = rng.bytes(len);
                frames.push((0x89, ping));
            }
            if rng.below(8) == 0 {
                let len = rng.below(10);
                frames.push((0x8a, rng.bytes(len)));
            }
        }
    }
    (frames, expected)
}

#[test]
fn random_legal_frames_in_random_splits_with_pings_arrive_unchanged_both_ways() {
    let relay = start_relay();
    let mut desktop = Desktop::connect(&relay);
    for seed in [1u64, 2, 3] {
        let mut rng = Rng(seed);
        let (mut phone, mut leg) = raw_splice(&relay, &mut desktop);
        for phone_sends in [true, false] {
            let (frames, expected) = random_traffic(&mut rng, 40);
            let pings: Vec<Vec<u8>> = frames
                .iter()
                .filter(|(first, _)| *first == 0x89)
                .map(|(_, payload)| payload.clone())
                .collect();
            let mut wire = Vec::new();
            for (first, payload) in &frames {
                let mask = (rng.next() as u32).to_be_bytes();
                wire.extend(client_frame(*first, payload, mask));
            }
            let (sender, receiver) = if phone_sends {
                (&mut phone, &mut leg)
            } else {
                (&mut leg, &mut phone)
            };
            // Write in random splits from another thread while this one reads.
            let mut writer = sender.stream.try_clone().unwrap();
            let splits: Vec<usize> = (0..wire.len()).map(|_| 1 + rng.below(70_000)).collect();
            let written = orca_relay::threads::spawn("test-writer", move || {
                let mut at = 0;
                for split in splits {
                    if at >= wire.len() {
                        break;
                    }
                    let to = (at + split).min(wire.len());
                    writer.write_all(&wire[at..to]).unwrap();
                    at = to;
                }
            })
            .unwrap();
            let mut got = Vec::new();
            while got.len() < expected.len() {
                let frame = receiver
                    .read_frame()
                    .expect("the receiving leg ended early");
                got.push(frame);
            }
            written.join().unwrap();
            assert_eq!(got.len(), expected.len(), "seed {seed}");
            for (i, (got, want)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    got == want,
                    "seed {seed} frame {i}: got ({:#x}, {} B), want ({:#x}, {} B)",
                    got.0,
                    got.1.len(),
                    want.0,
                    want.1.len()
                );
            }
            // Pings are answered on the sender's own leg, in order, with their payloads; the
            // relay owes at most one pong at a time (the latest ping's, RFC 6455 §5.5.3), so
            // pings that came together may share one, but the last is always answered.
            let mut from = 0;
            while let Some(last) = pings.last() {
                if from > 0 && &pings[from - 1] == last {
                    break;
                }
                let (first, payload) = sender.read_frame().expect("a pong");
                assert_eq!(first, 0x8a, "seed {seed}");
                let at = pings[from..]
                    .iter()
                    .position(|ping| *ping == payload)
                    .unwrap_or_else(|| panic!("seed {seed}: a pong for no later ping"));
                from += at + 1;
            }
        }
    }
}

#[test]
fn a_control_socket_breaking_a_framing_rule_is_closed_1002() {
    let relay = start_relay();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("unmasked", vec![0x81, 0x01, b'x']),
        (
            "continuation with no message open",
            client_frame(0x80, b"x", [1, 2, 3, 4]),
        ),
        ("rsv1", client_frame(0xc1, b"x", [1, 2, 3, 4])),
        (
            "ping of 126 bytes",
            client_frame(0x89, &[0; 126], [1, 2, 3, 4]),
        ),
        (
            "text frame while a message is open",
            [
                client_frame(0x01, b"{", [1, 2, 3, 4]),
                client_frame(0x81, b"x", [1, 2, 3, 4]),
            ]
            .concat(),
        ),
    ];
    let mut failures = Vec::new();
    for (name, bytes) in cases {
        let mut desktop = Desktop::connect(&relay);
        desktop.control.get_mut().write_all(&bytes).unwrap();
        let code = read_close(&mut desktop.control);
        if code != Some(1002) {
            failures.push(format!("{name}: close {code:?}, want 1002"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
