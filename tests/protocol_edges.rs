//! What a client's WebSocket library sees at the edges of the protocol (issue 33,
//! docs/PROTOCOL.md "What your WebSocket library reports"): the relay's answer to a close the
//! client starts carries the client's own code; after the relay's own close, the connection ends
//! as soon as the client has answered it (not a fixed linger later); a silent control is told
//! why; the cell's 401 body is the director's; every 1009 names the limit it hit.
//!
//! Black-box: the real binary over real sockets, with a raw RFC 6455 client so that every byte
//! and every moment is the client's to see.

mod harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use harness::*;

/// Longer than a relay that drops TCP on the client's answer ever takes on a loaded test
/// machine, shorter than the fixed one-second linger the relay used to wait after its close.
const PROMPT: Duration = Duration::from_millis(500);

/// A masked client frame.
fn client_frame(first: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [0x37, 0xfa, 0x21, 0x3d];
    let mut out = vec![first];
    header_length(&mut out, payload.len() as u64);
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
}

/// A masked client frame header declaring `len` payload bytes (none of which are sent).
fn client_header(first: u8, len: u64) -> Vec<u8> {
    let mut out = vec![first];
    header_length(&mut out, len);
    out.extend_from_slice(&[1, 2, 3, 4]);
    out
}

fn header_length(out: &mut Vec<u8>, len: u64) {
    if len < 126 {
        out.push(0x80 | len as u8);
    } else if len <= 0xffff {
        out.push(0x80 | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&len.to_be_bytes());
    }
}

fn close_payload(code: u16, reason: &str) -> Vec<u8> {
    let mut payload = code.to_be_bytes().to_vec();
    payload.extend_from_slice(reason.as_bytes());
    payload
}

/// The relay's close frame: its code (if any) and reason.
#[derive(Debug, PartialEq, Eq)]
struct Closed {
    code: Option<u16>,
    reason: String,
}

/// One WebSocket connection as raw bytes.
struct RawWs {
    stream: TcpStream,
}

impl RawWs {
    /// Upgrades `path` (with `bearer` as the desktop's token) and returns the socket right
    /// after the 101 head.
    fn upgrade(relay: &Relay, path: &str, bearer: Option<&str>) -> RawWs {
        let stream = TcpStream::connect(&relay.ws).unwrap();
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut ws = RawWs { stream };
        let authorization = bearer
            .map(|token| format!("Authorization: Bearer {token}\r\n"))
            .unwrap_or_default();
        ws.send_raw(
            format!(
                "GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{authorization}\r\n"
            )
            .as_bytes(),
        );
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert!(head.len() < 4096, "response head too long");
            ws.stream.read_exact(&mut byte).unwrap();
            head.push(byte[0]);
        }
        assert!(
            head.starts_with(b"HTTP/1.1 101"),
            "{}",
            String::from_utf8_lossy(&head)
        );
        ws
    }

    fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    fn send_json(&mut self, value: serde_json::Value) {
        self.send_raw(&client_frame(0x81, value.to_string().as_bytes()));
    }

    fn send_close(&mut self, code: u16, reason: &str) {
        self.send_raw(&client_frame(0x88, &close_payload(code, reason)));
    }

    /// The next frame: (first header byte, payload); `None` when the connection ends first.
    fn read_frame(&mut self) -> Option<(u8, Vec<u8>)> {
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

    /// The next JSON text message, skipping the relay's pings.
    fn read_json(&mut self) -> serde_json::Value {
        loop {
            let (first, payload) = self.read_frame().expect("a frame");
            if first == 0x81 {
                let value: serde_json::Value = serde_json::from_slice(&payload).unwrap();
                if value["type"] != "ping" {
                    return value;
                }
            } else {
                assert_ne!(
                    first & 0x0f,
                    0x8,
                    "closed: {:?}",
                    String::from_utf8_lossy(&payload)
                );
            }
        }
    }

    /// Reads up to the relay's close frame (`None`: the connection ended without one).
    fn read_close(&mut self) -> Option<Closed> {
        while let Some((first, payload)) = self.read_frame() {
            if first & 0x0f == 0x8 {
                let code =
                    (payload.len() >= 2).then(|| u16::from_be_bytes([payload[0], payload[1]]));
                let reason = String::from_utf8_lossy(payload.get(2..).unwrap_or_default());
                return Some(Closed {
                    code,
                    reason: reason.into_owned(),
                });
            }
        }
        None
    }

    /// After the relay's close: answers it with the same code, as every library does, and
    /// returns how long the relay then kept the TCP connection (until its end of stream).
    fn answer_close(&mut self, code: u16) -> Duration {
        self.send_close(code, "");
        let answered = now_instant();
        let mut rest = Vec::new();
        // Whatever comes (nothing should), until the end of stream or a reset.
        let _ = (&self.stream).take(1 << 20).read_to_end(&mut rest);
        let kept = answered.elapsed();
        assert!(rest.is_empty(), "bytes after the close: {rest:?}");
        kept
    }
}

/// A desktop's control, raw, past its hello: (relay host id, token, generation, control).
fn raw_desktop(relay: &Relay) -> (String, String, u64, RawWs) {
    let relay_host_id = host_id();
    let token = token(&format!("user-{relay_host_id}"), &relay_host_id);
    let epoch = assign(relay, &token, &relay_host_id);
    let mut control = RawWs::upgrade(relay, "/v1/host/control", Some(&token));
    control.send_json(serde_json::json!({
        "type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch
    }));
    let ack = control.read_json();
    assert_eq!(ack["type"], "host-hello-ack", "{ack}");
    let generation = ack["generation"].as_u64().unwrap();
    (relay_host_id, token, generation, control)
}

fn invite(control: &mut RawWs) -> String {
    control.send_json(serde_json::json!({"type":"invite-create","reqId":1}));
    let created = control.read_json();
    assert_eq!(created["type"], "invite-created", "{created}");
    created["inviteToken"].as_str().unwrap().to_string()
}

/// A phone spliced to a data leg of the desktop whose control is `control`: (phone, leg).
fn raw_splice(
    relay: &Relay,
    relay_host_id: &str,
    generation: u64,
    control: &mut RawWs,
) -> (RawWs, RawWs) {
    let invite = invite(control);
    let mut phone = RawWs::upgrade(relay, &format!("/v1/connect/{relay_host_id}"), None);
    phone.send_json(serde_json::json!({"type":"relay-auth","v":1,"credential":invite}));
    let open = control.read_json();
    assert_eq!(open["type"], "conn-open", "{open}");
    let mut leg = RawWs::upgrade(
        relay,
        &format!("/v1/host/data/{}", open["connId"].as_str().unwrap()),
        None,
    );
    leg.send_json(serde_json::json!({
        "type":"host-data-auth","v":1,"connTicket":open["connTicket"],"generation":generation
    }));
    assert_eq!(
        phone.read_json(),
        serde_json::json!({"type":"relay-hello","ok":true})
    );
    (phone, leg)
}

/// RFC 6455 §5.5.1: the endpoint that answers a close "typically echoes the status code it
/// received". The relay used to answer with an empty close frame, which every library reports
/// as 1005, not the 1000 or 4000 the client sent: an app checking its own clean close saw 1005.
#[test]
fn a_close_the_client_starts_is_answered_with_its_code() {
    let relay = Relay::combined(&[]);
    let (relay_host_id, _, generation, mut control) = raw_desktop(&relay);
    let (mut phone, mut leg) = raw_splice(&relay, &relay_host_id, generation, &mut control);

    // A spliced phone closes 1000: its answer is 1000; the desktop's data leg hears 4408.
    phone.send_close(1000, "bye");
    let answer = phone.read_close();
    assert_eq!(answer.map(|c| c.code), Some(Some(1000)), "phone's answer");
    let told = leg.read_close().expect("the data leg is closed");
    assert_eq!(told.code, Some(4408));
    leg.answer_close(4408);

    // A spliced data leg closes 4000.
    let (mut phone, mut leg) = raw_splice(&relay, &relay_host_id, generation, &mut control);
    leg.send_close(4000, "");
    assert_eq!(
        leg.read_close().map(|c| c.code),
        Some(Some(4000)),
        "leg's answer"
    );
    assert_eq!(phone.read_close().map(|c| c.code), Some(Some(4408)));
    phone.answer_close(4408);

    // A phone that closes before its first frame (the pending plane answers).
    let mut early = RawWs::upgrade(&relay, &format!("/v1/connect/{relay_host_id}"), None);
    early.send_close(4001, "changed my mind");
    assert_eq!(
        early.read_close().map(|c| c.code),
        Some(Some(4001)),
        "pending leg's answer"
    );

    // The control itself closes 1000 (a desktop that moved to another cell).
    control.send_close(1000, "moving");
    assert_eq!(
        control.read_close().map(|c| c.code),
        Some(Some(1000)),
        "control's answer"
    );
}

/// After the relay's own close the TCP connection ends as soon as the client has answered it:
/// a library reports the close when the connection ends, so a refusal surfaces at once and a
/// deadline at its time, not a one-second linger later (the first-frame deadline of 2 s used to
/// be reported at 3 s). One path of each kind: the pending plane (a refused credential, a late
/// first frame), a phone's thread (no data leg in time), a control's thread (a refused hello,
/// silence, a control replaced from another thread), a splice worker (the peer left).
#[test]
fn the_connection_ends_as_soon_as_the_client_answers_the_relays_close() {
    let first_frame_ms = 600;
    let relay = Relay::combined(&[
        ("ORCA_RELAY_FIRST_FRAME_MS", &first_frame_ms.to_string()),
        ("ORCA_RELAY_ATTACH_DEADLINE_MS", "500"),
        ("ORCA_RELAY_SILENCE_MS", "4000"),
        ("ORCA_RELAY_PING_MS", "600000"),
    ]);
    let mut kept = Vec::new();
    let (relay_host_id, token, generation, mut control) = raw_desktop(&relay);

    // Pending plane: a phone with an invite that is not one.
    let mut phone = RawWs::upgrade(&relay, &format!("/v1/connect/{relay_host_id}"), None);
    phone.send_json(serde_json::json!({"type":"relay-auth","v":1,"credential":"not-an-invite"}));
    let closed = phone.read_close().expect("a close frame");
    assert_eq!(closed.code, Some(4401));
    kept.push(("bad invite 4401", phone.answer_close(4401)));

    // Pending plane: a data leg that never sends its first frame.
    let mut late = RawWs::upgrade(&relay, "/v1/host/data/nobody", None);
    let upgraded = now_instant();
    let closed = late.read_close().expect("a close frame");
    let closed_after = upgraded.elapsed();
    assert_eq!(closed.code, Some(4401));
    assert!(
        closed_after >= Duration::from_millis(first_frame_ms)
            && closed_after < Duration::from_millis(first_frame_ms) + PROMPT,
        "the first-frame deadline of {first_frame_ms} ms closed at {closed_after:?}"
    );
    kept.push(("first frame late 4401", late.answer_close(4401)));

    // A phone's thread: the desktop never opens the data leg.
    let invite = invite(&mut control);
    let mut phone = RawWs::upgrade(&relay, &format!("/v1/connect/{relay_host_id}"), None);
    phone.send_json(serde_json::json!({"type":"relay-auth","v":1,"credential":invite}));
    assert_eq!(control.read_json()["type"], "conn-open");
    let closed = phone.read_close().expect("a close frame");
    assert_eq!(closed.code, Some(4404));
    kept.push(("no data leg 4404", phone.answer_close(4404)));

    // A splice worker: the phone leaves, its data leg is told 4408.
    let (mut phone, mut leg) = raw_splice(&relay, &relay_host_id, generation, &mut control);
    phone.send_close(1000, "");
    assert!(phone.read_close().is_some());
    let closed = leg.read_close().expect("a close frame");
    assert_eq!(closed.code, Some(4408));
    kept.push(("peer left 4408", leg.answer_close(4408)));

    // A control's thread: a hello naming another host.
    let mut refused = RawWs::upgrade(&relay, "/v1/host/control", Some(&token));
    refused.send_json(serde_json::json!({
        "type":"host-hello","v":1,"relayHostId":"someone-else-000","assignmentEpoch":1
    }));
    let closed = refused.read_close().expect("a close frame");
    assert_eq!(closed.code, Some(4401));
    kept.push(("bad hello 4401", refused.answer_close(4401)));

    // Another thread closes a control: a newer control of the same desktop replaces it.
    let epoch = assign(&relay, &token, &relay_host_id);
    let mut newer = RawWs::upgrade(&relay, "/v1/host/control", Some(&token));
    newer.send_json(serde_json::json!({
        "type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch
    }));
    assert_eq!(newer.read_json()["type"], "host-hello-ack");
    let closed = control.read_close().expect("a close frame");
    assert_eq!(closed.code, Some(4408));
    kept.push(("replaced 4408", control.answer_close(4408)));

    // A control's thread: silence (no pings are sent, and the desktop sends nothing).
    let closed = newer.read_close().expect("a close frame");
    assert_eq!(closed.code, Some(4408));
    kept.push(("silent 4408", newer.answer_close(4408)));

    eprintln!("kept after the answer: {kept:?}");
    let slow: Vec<_> = kept.iter().filter(|(_, kept)| *kept >= PROMPT).collect();
    assert!(
        slow.is_empty(),
        "the relay kept the connection after the client's answer: {slow:?} (all: {kept:?})"
    );
}

/// A control closed for silence is told so in the close reason: its code is 4408 like a
/// replaced control's, and a desktop that forgot to answer pings must be able to tell.
#[test]
fn a_silent_control_is_closed_4408_with_a_reason_of_its_own() {
    let relay = Relay::combined(&[
        ("ORCA_RELAY_SILENCE_MS", "800"),
        ("ORCA_RELAY_PING_MS", "600000"),
    ]);
    let (_, _, _, mut control) = raw_desktop(&relay);
    let closed = control.read_close().expect("a close frame");
    assert_eq!(
        closed,
        Closed {
            code: Some(4408),
            reason: "silent: nothing heard (answer pings)".into()
        }
    );
}

/// The cell refuses a control's token with the body the director gives the same token at
/// `POST /v1/assign`: `{"error":"unauthorized","reason":…}`.
#[test]
fn the_cells_401_body_is_the_directors() {
    let relay = Relay::combined(&[]);
    let relay_host_id = host_id();
    // A well-formed token signed with a key the relay does not have.
    let bad = orca_relay::auth::mint_host_token(
        "not-the-relays-key-0123456789abcdefghijklmnop",
        None,
        "orca-relay",
        "u-401",
        &relay_host_id,
        600,
        orca_relay::clock::system().as_ref(),
    );
    let (status, director_body) = relay.post(
        "/v1/assign",
        Some(&bad),
        &serde_json::json!({"v":1,"relayHostId":relay_host_id}).to_string(),
    );
    assert_eq!(status, 401, "{director_body}");
    let mut conn = harness::raw_http::Conn::connect(&relay.ws);
    conn.send(
        format!(
            "GET /v1/host/control HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nAuthorization: Bearer {bad}\r\n\r\n"
        )
        .as_bytes(),
    )
    .unwrap();
    let response = conn.read_response(Duration::from_secs(10)).unwrap();
    assert_eq!(response.status, 401);
    let cell: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
    let director: serde_json::Value = serde_json::from_str(&director_body).unwrap();
    assert_eq!(cell, director);
    assert_eq!(cell["error"], "unauthorized");
    assert_eq!(cell["reason"], "token_bad_signature");
}

/// Every 1009 says which limit it hit: `message_too_large` for a message over the control's
/// 1 MiB or a leg's 8 MiB (in one frame on the control, in fragments on a leg),
/// `frame_too_large` for a leg's single frame over 8 MiB, `first_frame_too_large` for a phone's
/// or data leg's first frame over 4 KiB. Each is refused from its header.
#[test]
fn every_1009_names_the_limit_it_hit() {
    const MIB: u64 = 1024 * 1024;
    let relay = Relay::combined(&[]);
    let mut seen = Vec::new();

    // The control's first frame over 1 MiB.
    let relay_host_id = host_id();
    let token = token(&format!("user-{relay_host_id}"), &relay_host_id);
    let mut control = RawWs::upgrade(&relay, "/v1/host/control", Some(&token));
    control.send_raw(&client_header(0x81, MIB + 1));
    seen.push(("control first frame", control.read_close()));

    // A control frame over 1 MiB, then a control message over 1 MiB in two fragments.
    let (_, _, _, mut control) = raw_desktop(&relay);
    control.send_raw(&client_header(0x82, MIB + 1));
    seen.push(("control frame", control.read_close()));
    let (_, _, _, mut control) = raw_desktop(&relay);
    control.send_raw(&client_frame(0x02, b"x"));
    control.send_raw(&client_header(0x80, MIB));
    seen.push(("control message", control.read_close()));

    // A phone's first frame over 4 KiB.
    let (relay_host_id, _, generation, mut control) = raw_desktop(&relay);
    let mut phone = RawWs::upgrade(&relay, &format!("/v1/connect/{relay_host_id}"), None);
    phone.send_raw(&client_header(0x81, 4 * 1024 + 1));
    seen.push(("phone first frame", phone.read_close()));

    // A spliced leg: one frame over 8 MiB; a message over 8 MiB in fragments.
    let (mut phone, _leg) = raw_splice(&relay, &relay_host_id, generation, &mut control);
    phone.send_raw(&client_header(0x82, 8 * MIB + 1));
    seen.push(("leg frame", phone.read_close()));
    let (_phone, mut leg) = raw_splice(&relay, &relay_host_id, generation, &mut control);
    leg.send_raw(&client_frame(0x02, b"x"));
    leg.send_raw(&client_header(0x80, 8 * MIB));
    seen.push(("leg message", leg.read_close()));

    let expected = [
        ("control first frame", "message_too_large"),
        ("control frame", "message_too_large"),
        ("control message", "message_too_large"),
        ("phone first frame", "first_frame_too_large"),
        ("leg frame", "frame_too_large"),
        ("leg message", "message_too_large"),
    ];
    let expected: Vec<_> = expected
        .iter()
        .map(|(what, reason)| {
            (
                *what,
                Some(Closed {
                    code: Some(1009),
                    reason: reason.to_string(),
                }),
            )
        })
        .collect();
    assert_eq!(seen, expected);
}

/// A control that sends frames the relay ignores (binary frames, unknown `type`s) costs the
/// log one line, then at most one a minute with how many since: not a line per frame (before,
/// 600 such frames wrote 600 INFO lines, one desktop's loop filling the journal).
#[test]
fn frames_a_control_ignores_are_logged_once_not_once_each() {
    let relay = Relay::combined(&[]);
    let (relay_host_id, _token, _generation, mut control) = raw_desktop(&relay);
    for i in 0..300 {
        control.send_raw(&client_frame(0x82, &[i as u8; 16]));
        control.send_json(serde_json::json!({"type": "no-such-type", "n": i}));
    }
    // Frames are acted on in order: the answer to this one comes after every ignored one.
    let _ = invite(&mut control);
    let log = relay.log_text();
    let ignored: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("orca_relay_control_frame_ignored"))
        .collect();
    assert_eq!(ignored.len(), 1, "{ignored:?}");
    assert!(
        ignored[0].contains(&format!("host={relay_host_id}"))
            && ignored[0].contains("reason=binary"),
        "{}",
        ignored[0]
    );
}
