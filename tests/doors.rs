//! The doors of a cell against the real binary (issue 19; SPEC §12 "Unauthenticated means
//! pending" and "HTTP server"): nobody without a credential holds a desktop's place, and the HTTP
//! edge follows RFC 9112 where a front proxy or a client can tell.
//!
//! - Phone and data-leg sockets that ping, trickle or declare an 8 MiB first frame take no unit of
//!   the connection cap, are closed at their absolute deadline, and cost a few KiB each while
//!   pending; a desktop is admitted within 1 s beside two thousand of them.
//! - A desktop's invites are bounded, `invite-create` is rate-limited, its invites go when its
//!   control leaves.
//! - Withheld bodies never keep `/ready` or a feed poll from their 200; an answer comes before the
//!   unread body is discarded.
//! - `://` in a query never reroutes a request; Host, request-line length, `Expect` on HTTP/1.0;
//!   the upgrade's key, version, method and malformed heads.
//! - Refused API requests are counted and their log lines throttled.

mod harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::raw_http::Conn;
use harness::*;
use orca_relay::clock;
use tungstenite::Message;

/// A valid `Sec-WebSocket-Key` (RFC 6455's example).
const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

fn upgrade_request(path: &str, extra: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {KEY}\r\n{extra}\r\n"
    )
}

/// The resident set of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Reads one response head from a raw stream: (status, head text, bytes after the head).
fn read_head(stream: &mut TcpStream, timeout: Duration) -> Option<(u16, String, Vec<u8>)> {
    let deadline = clock::instant() + timeout;
    let mut received = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&received[..end + 4]).into_owned();
            let status = head.split_whitespace().nth(1)?.parse().ok()?;
            return Some((status, head, received[end + 4..].to_vec()));
        }
        let left = deadline.saturating_duration_since(clock::instant());
        if left.is_zero() {
            return None;
        }
        stream.set_read_timeout(Some(left)).ok()?;
        match stream.read(&mut chunk) {
            Ok(0) => return None,
            Ok(n) => received.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

/// Sends raw bytes on a fresh connection and reads one response (None: closed or nothing).
fn raw_exchange(addr: &str, bytes: &[u8]) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream.write_all(bytes).ok()?;
    read_head(&mut stream, Duration::from_secs(10)).map(|(status, head, _)| (status, head))
}

// ---------------------------------------------------------------------------------------------
// Pending phone and data legs.

/// What an attacking socket does after its upgrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attack {
    /// Sends a ping every period and never a first frame.
    Ping,
    /// Starts a 200-byte text frame and sends one byte of it every period.
    Trickle,
    /// Declares an 8 MiB text frame and sends one byte of it every period.
    Declare8MiB,
}

struct Attacker {
    stream: TcpStream,
    attack: Attack,
    upgraded_at: Instant,
    closed_at: Option<Instant>,
}

/// The next masked client bytes an attacker sends, by kind.
fn attack_bytes(attack: Attack, first: bool) -> Vec<u8> {
    let mask = [0x11, 0x22, 0x33, 0x44];
    match (attack, first) {
        (Attack::Ping, _) => {
            let mut out = Vec::new();
            orca_relay::relay::frames::encode_client_frame(0x89, b"hi", mask, &mut out);
            out
        }
        (Attack::Trickle, true) => {
            let mut out = vec![0x81, 0x80 | 126];
            out.extend_from_slice(&200u16.to_be_bytes());
            out.extend_from_slice(&mask);
            out
        }
        (Attack::Declare8MiB, true) => {
            let mut out = vec![0x81, 0x80 | 127];
            out.extend_from_slice(&(8u64 * 1024 * 1024).to_be_bytes());
            out.extend_from_slice(&mask);
            out
        }
        (_, false) => vec![b'x'],
    }
}

/// Opens `count` upgrades on `path_of(n)`, each then attacking as `attack_of(n)`. Returns the
/// attackers that were answered 101, and the other statuses seen.
fn open_attackers(
    ws: &str,
    count: usize,
    path_of: impl Fn(usize) -> String,
    attack_of: impl Fn(usize) -> Attack,
) -> (Vec<Attacker>, Vec<u16>) {
    let mut attackers = Vec::new();
    let mut refused = Vec::new();
    for n in 0..count {
        let Ok(mut stream) = TcpStream::connect(ws) else {
            refused.push(0);
            continue;
        };
        if stream
            .write_all(upgrade_request(&path_of(n), "").as_bytes())
            .is_err()
        {
            refused.push(0);
            continue;
        }
        match read_head(&mut stream, Duration::from_secs(5)) {
            Some((101, _, _)) => {
                let attack = attack_of(n);
                let upgraded_at = clock::instant();
                let _ = stream.write_all(&attack_bytes(attack, true));
                stream.set_nonblocking(true).unwrap();
                attackers.push(Attacker {
                    stream,
                    attack,
                    upgraded_at,
                    closed_at: None,
                });
            }
            Some((status, _, _)) => refused.push(status),
            None => refused.push(0),
        }
    }
    (attackers, refused)
}

/// Keeps the attackers going (a ping or a byte every `every`) and notes when each is closed (a
/// close frame or the end of the stream), until `stop` or every one is closed.
fn drive_attackers(attackers: &mut [Attacker], every: Duration, stop: &AtomicBool) {
    use mio::unix::SourceFd;
    use mio::{Events, Interest, Poll, Token};
    let mut poll = Poll::new().unwrap();
    for (n, attacker) in attackers.iter().enumerate() {
        poll.registry()
            .register(
                &mut SourceFd(&attacker.stream.as_raw_fd()),
                Token(n),
                Interest::READABLE,
            )
            .unwrap();
    }
    let mut events = Events::with_capacity(1024);
    let mut next_send = clock::instant() + every;
    let mut chunk = [0u8; 4096];
    while !stop.load(Ordering::Acquire) && attackers.iter().any(|a| a.closed_at.is_none()) {
        let _ = poll.poll(&mut events, Some(Duration::from_millis(20)));
        let now = clock::instant();
        for event in events.iter() {
            let attacker = &mut attackers[event.token().0];
            if attacker.closed_at.is_some() {
                continue;
            }
            loop {
                match attacker.stream.read(&mut chunk) {
                    Ok(0) => {
                        attacker.closed_at = Some(now);
                        break;
                    }
                    // Any close frame (0x88) from the relay ends the attacker's pending life.
                    Ok(n) if chunk[..n].contains(&0x88) => {
                        attacker.closed_at = Some(now);
                        break;
                    }
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        attacker.closed_at = Some(now);
                        break;
                    }
                }
            }
        }
        if now >= next_send {
            next_send = now + every;
            for attacker in attackers.iter_mut().filter(|a| a.closed_at.is_none()) {
                let _ = attacker.stream.write(&attack_bytes(attacker.attack, false));
            }
        }
    }
}

/// Two thousand unauthenticated splice legs (a thousand on each path, pinging, trickling or
/// declaring 8 MiB) with a cap of 20: a desktop is admitted within 1 s and pairs a phone, every
/// attacker is closed by its absolute first-frame deadline however it keeps sending, and each
/// costs under 16 KiB of the relay's RSS while pending.
#[test]
fn pending_phone_and_data_legs_never_keep_a_desktop_out() {
    const EACH: usize = 1000;
    const FIRST_FRAME_MS: u64 = 3000;
    // This process holds the two thousand attacking sockets.
    let _ = orca_relay::lifecycle::raise_fd_limit();
    // The attackers stand for two thousand hosts: this process is one source address, so the
    // per-source bound is lifted to the table's.
    let relay = Relay::combined(&[
        ("ORCA_RELAY_CONNECTION_CAP", "20"),
        ("ORCA_RELAY_PENDING_UPGRADES_MAX", "4096"),
        ("ORCA_RELAY_PENDING_PER_SOURCE_MAX", "4096"),
        ("ORCA_RELAY_FIRST_FRAME_MS", "3000"),
    ]);
    let warm = Desktop::connect(&relay);
    drop(warm);
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connection_units")
        == Some(0.0)));
    let rss_before = rss_kib(relay.pid());

    // Two openers in parallel: phones on /v1/connect/<id>, data legs on /v1/host/data/<id>.
    let kinds = [Attack::Ping, Attack::Trickle, Attack::Declare8MiB];
    let openers: Vec<_> = ["/v1/connect/", "/v1/host/data/"]
        .into_iter()
        .enumerate()
        .map(|(side, prefix)| {
            let ws = relay.ws.clone();
            orca_relay::threads::spawn(format!("test-open-{side}"), move || {
                open_attackers(
                    &ws,
                    EACH,
                    |n| {
                        if prefix.contains("connect") {
                            format!("{prefix}attacker{n:08}")
                        } else {
                            format!("{prefix}{n:x}-{n}")
                        }
                    },
                    |n| kinds[n % 3],
                )
            })
            .unwrap()
        })
        .collect();
    let mut attackers = Vec::new();
    let mut refused = Vec::new();
    for opener in openers {
        let (opened, statuses) = opener.join().unwrap();
        attackers.extend(opened);
        refused.extend(statuses);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let driver = {
        let stop = stop.clone();
        orca_relay::threads::spawn("test-attackers", move || {
            drive_attackers(&mut attackers, Duration::from_millis(400), &stop);
            attackers
        })
        .unwrap()
    };
    // While they are pending: what they cost, and a desktop that gets in within 1 s.
    let pending = relay
        .metric("orca_relay_ws_pending_upgrades")
        .unwrap_or(0.0);
    let rss_during = rss_kib(relay.pid());
    let started = clock::instant();
    let mut desktop = Desktop::connect(&relay);
    let took = started.elapsed();
    let (mut phone, mut leg) = splice(&relay, &mut desktop);
    phone.send(Message::text("through")).unwrap();
    assert_eq!(read_json_text(&mut leg), "through");
    eprintln!(
        "pending={pending} rss_before={rss_before} KiB rss_during={rss_during} KiB desktop admitted in {took:?}; refused upgrades: {}",
        refused.len()
    );
    assert!(
        refused.is_empty(),
        "upgrades refused before any credential: {:?}",
        &refused[..refused.len().min(10)]
    );
    assert!(took < Duration::from_secs(1), "the desktop took {took:?}");
    // The pingers and tricklers (two thirds) are pending; the 8 MiB declarers are closed as
    // soon as their header arrives.
    assert!(
        pending >= 1200.0,
        "only {pending} pending when measured (openers too slow?)"
    );
    let per_socket = rss_during.saturating_sub(rss_before) as f64 / pending;
    assert!(
        per_socket < 16.0,
        "{per_socket:.1} KiB of RSS per pending socket"
    );

    // Each attacker is closed by its deadline: the first frame is due FIRST_FRAME_MS after the
    // upgrade, whatever it sends in between (a generous margin for a loaded machine).
    let finished = wait_until(Duration::from_secs(15), || driver.is_finished());
    stop.store(true, Ordering::Release);
    let attackers = driver.join().unwrap();
    assert!(finished, "attackers still open 15 s later");
    let due = Duration::from_millis(FIRST_FRAME_MS) + Duration::from_millis(1500);
    for kind in kinds {
        let lives: Vec<Duration> = attackers
            .iter()
            .filter(|a| a.attack == kind)
            .map(|a| {
                a.closed_at
                    .map(|at| at.duration_since(a.upgraded_at))
                    .unwrap_or(Duration::MAX)
            })
            .collect();
        let longest = lives.iter().max().copied().unwrap_or_default();
        eprintln!(
            "{kind:?}: {} sockets, longest life {longest:?}",
            lives.len()
        );
        assert!(
            longest <= due,
            "{kind:?} attacker lived {longest:?}, past its deadline"
        );
    }
    // They held nothing: the desktop and its pair are the only units.
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_ws_pending_upgrades")
        == Some(0.0)));
    assert_eq!(relay.metric("orca_relay_connection_units"), Some(3.0));
}

/// A desktop with a valid token that trickles its hello (a byte every 200 ms) is closed 4401 at
/// its first-frame deadline: the bytes do not extend it.
#[test]
fn a_control_that_trickles_its_hello_is_closed_at_its_deadline() {
    let relay = Relay::combined(&[("ORCA_RELAY_FIRST_FRAME_MS", "1000")]);
    let relay_host_id = host_id();
    let token = token(&format!("user-{relay_host_id}"), &relay_host_id);
    let mut stream = TcpStream::connect(&relay.ws).unwrap();
    stream
        .write_all(
            upgrade_request(
                "/v1/host/control",
                &format!("Authorization: Bearer {token}\r\n"),
            )
            .as_bytes(),
        )
        .unwrap();
    let (status, _, _) = read_head(&mut stream, Duration::from_secs(5)).expect("an answer");
    assert_eq!(status, 101);
    let upgraded = clock::instant();
    let hello = serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":1}).to_string();
    let mut frame = Vec::new();
    orca_relay::relay::frames::encode_client_frame(
        0x81,
        hello.as_bytes(),
        [5, 6, 7, 8],
        &mut frame,
    );
    let mut writer = stream.try_clone().unwrap();
    let trickle = orca_relay::threads::spawn("test-hello-trickle", move || {
        for byte in frame {
            if writer.write_all(&[byte]).is_err() {
                return;
            }
            clock::sleep(Duration::from_millis(200));
        }
    })
    .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let mut answer = [0u8; 4];
    let closed = stream.read_exact(&mut answer);
    let took = upgraded.elapsed();
    drop(stream);
    let _ = trickle.join();
    assert!(closed.is_ok(), "no close frame: {closed:?} after {took:?}");
    assert_eq!(answer[0], 0x88, "a close frame");
    assert_eq!(u16::from_be_bytes([answer[2], answer[3]]), 4401);
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
}

/// Unauthenticated splice legs that flood control frames as fast as they can (pongs: they need
/// no reading) never hold the acceptor's loop: other upgrades are answered meanwhile, and each
/// flooder is closed at its first-frame deadline however fast it sends.
#[test]
fn pending_legs_that_flood_control_frames_never_hold_the_acceptor() {
    const FLOODERS: usize = 3;
    const GIVE_UP: Duration = Duration::from_secs(15);
    let relay = Relay::combined(&[("ORCA_RELAY_FIRST_FRAME_MS", "1000")]);
    let mut pong = Vec::new();
    orca_relay::relay::frames::encode_client_frame(0x8A, b"", [1, 2, 3, 4], &mut pong);
    let batch: Arc<Vec<u8>> = Arc::new(pong.iter().copied().cycle().take(60_000).collect());
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // All upgraded first, then all flooding.
    let upgraded: Vec<_> = (0..FLOODERS)
        .map(|n| {
            let mut stream = TcpStream::connect(&relay.ws).unwrap();
            stream
                .write_all(upgrade_request(&format!("/v1/connect/flood{n}"), "").as_bytes())
                .unwrap();
            let (status, _, _) = read_head(&mut stream, Duration::from_secs(5)).expect("an answer");
            assert_eq!(status, 101);
            stream
                .set_write_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            (stream, clock::instant())
        })
        .collect();
    let flooders: Vec<_> = upgraded
        .into_iter()
        .enumerate()
        .map(|(n, (mut stream, upgraded))| {
            let (batch, sent) = (batch.clone(), sent.clone());
            orca_relay::threads::spawn(format!("test-flood-{n}"), move || {
                // Until the relay drops the connection (or the test gives up).
                while upgraded.elapsed() < GIVE_UP && stream.write_all(&batch).is_ok() {
                    sent.fetch_add(batch.len() as u64, Ordering::Relaxed);
                }
                upgraded.elapsed()
            })
            .unwrap()
        })
        .collect();
    assert!(
        wait_until(Duration::from_secs(5), || sent.load(Ordering::Relaxed)
            >= 4 << 20),
        "the flood started"
    );
    // While they flood, other connections are upgraded at once.
    for n in 0..5 {
        let started = clock::instant();
        let mut stream = TcpStream::connect(&relay.ws).unwrap();
        stream
            .write_all(upgrade_request(&format!("/v1/connect/probe{n}"), "").as_bytes())
            .unwrap();
        let answer = read_head(&mut stream, Duration::from_secs(3));
        let took = started.elapsed();
        assert_eq!(
            answer.map(|(status, _, _)| status),
            Some(101),
            "an upgrade beside the flood was not answered within {took:?}"
        );
        assert!(
            took < Duration::from_secs(1),
            "an upgrade beside the flood took {took:?}"
        );
    }
    // Each flooder is closed at its deadline: 1 s after its upgrade, then the close linger.
    for flooder in flooders {
        let lived = flooder.join().unwrap();
        assert!(
            lived < Duration::from_secs(6),
            "a flooding pending leg lived {lived:?}"
        );
    }
}

/// A desktop token whose key needs a JWKS fetch is checked off the acceptor's loop: while that
/// fetch takes 1.5 s, another desktop (a cached key) is upgraded at once.
#[test]
fn a_slow_jwks_fetch_never_stalls_other_upgrades() {
    const ROTATED: &str = "rotated-kid";
    // The first fetch (the readiness probe at start) serves the test key; every later one
    // answers 1.5 s late with the rotated kid as well.
    let fetches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let jwks = {
        let fetches = fetches.clone();
        let first = jwks_body();
        let mut both: serde_json::Value = serde_json::from_str(&first).unwrap();
        let mut rotated = both["keys"][0].clone();
        rotated["kid"] = serde_json::json!(ROTATED);
        both["keys"].as_array_mut().unwrap().push(rotated);
        let both = both.to_string();
        FakeServer::start(move |_| {
            if fetches.fetch_add(1, Ordering::SeqCst) == 0 {
                (200, first.clone())
            } else {
                // The slow key server the scenario is about.
                clock::sleep(Duration::from_millis(1500));
                (200, both.clone())
            }
        })
    };
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let relay = Relay::combined(&[
        ("ORCA_RELAY_JWKS_URL", jwks_url.as_str()),
        ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ("ORCA_RELAY_READINESS_PROBE_MS", "600000"),
    ]);
    assert!(wait_until(Duration::from_secs(10), || fetches
        .load(Ordering::SeqCst)
        >= 1
        && relay.get("/ready").0 == 200));
    let rotated = {
        let url = relay.ws_url("/v1/host/control");
        let host = host_id();
        let token = es256_token_with_kid(ROTATED, &format!("user-{host}"), &host);
        orca_relay::threads::spawn("test-rotated-desktop", move || {
            let started = clock::instant();
            (try_upgrade(&url, Some(&token)), started.elapsed())
        })
        .unwrap()
    };
    assert!(
        wait_until(Duration::from_secs(10), || fetches.load(Ordering::SeqCst)
            >= 2),
        "the unknown kid fetched the key set"
    );
    let host = host_id();
    let token = es256_token(&format!("user-{host}"), &host);
    let started = clock::instant();
    let cached = try_upgrade(&relay.ws_url("/v1/host/control"), Some(&token));
    let took = started.elapsed();
    let (rotated, rotated_took) = rotated.join().unwrap();
    eprintln!("cached key upgraded in {took:?}; the rotated kid in {rotated_took:?}");
    assert_eq!(cached, Upgrade::Opened);
    assert!(
        took < Duration::from_secs(1),
        "a cached key waited {took:?}"
    );
    assert_eq!(rotated, Upgrade::Opened, "the fetched key verifies");
    assert!(rotated_took >= Duration::from_millis(1400));
}

fn read_json_text(ws: &mut Ws) -> String {
    loop {
        match ws.read().expect("read") {
            Message::Text(text) => return text.to_string(),
            Message::Close(frame) => panic!("closed: {frame:?}"),
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Invites.

/// A desktop that asks for 10,000 invites keeps at most a few outstanding (the oldest
/// replaced, the rest refused by the rate limit) and the relay's memory flat; its invites go when
/// its control leaves.
#[test]
fn ten_thousand_invite_creates_leave_the_bound_outstanding() {
    const CREATES: usize = 10_000;
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let first = desktop.invite();
    let rss_before = rss_kib(relay.pid());
    let writer = desktop.control.get_ref().try_clone().unwrap();
    // The frames are written by another thread while this one reads the answers, so neither
    // side's buffers fill.
    let sender = orca_relay::threads::spawn("test-invite-flood", move || {
        let mut writer = writer;
        let mut batch = Vec::new();
        for n in 0..CREATES {
            let text = format!(r#"{{"type":"invite-create","reqId":{n}}}"#);
            orca_relay::relay::frames::encode_client_frame(
                0x81,
                text.as_bytes(),
                [1, 2, 3, 4],
                &mut batch,
            );
            if batch.len() > 16 * 1024 {
                writer.write_all(&batch).unwrap();
                batch.clear();
            }
        }
        writer.write_all(&batch).unwrap();
    })
    .unwrap();
    let (mut created, mut refused) = (0, 0);
    while created + refused < CREATES {
        let answer = read_json(&mut desktop.control);
        match answer["type"].as_str() {
            Some("invite-created") => created += 1,
            Some("invite-refused") => {
                assert_eq!(answer["reason"], "rate_limited", "{answer}");
                refused += 1
            }
            _ => panic!("unexpected answer {answer}"),
        }
    }
    sender.join().unwrap();
    let rss_after = rss_kib(relay.pid());
    let outstanding = relay.metric("orca_relay_invites_outstanding");
    eprintln!(
        "created={created} refused={refused} outstanding={outstanding:?} rss {rss_before} -> {rss_after} KiB"
    );
    assert!(
        outstanding.is_some_and(|n| n <= 8.0),
        "outstanding invites: {outstanding:?}"
    );
    assert!(
        rss_after <= rss_before + 1024,
        "RSS grew by {} KiB",
        rss_after - rss_before
    );
    // One more invite, once the rate allows it: the ninth replaces the oldest, which then
    // admits no phone.
    let kept = desktop.invite();
    assert!(relay
        .metric("orca_relay_invites_outstanding")
        .is_some_and(|n| n <= 8.0));
    let phone_url = relay.ws_url(&format!("/v1/connect/{}", desktop.relay_host_id));
    let mut phone = ws_connect(&phone_url, None).unwrap();
    send_json(
        &mut phone,
        serde_json::json!({"type":"relay-auth","v":1,"credential":first}),
    );
    assert_eq!(read_close(&mut phone), Some(4401));
    // Every invite goes when the control leaves.
    let _ = desktop.control.close(None);
    drop(desktop);
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connections{kind=\"control\"}")
        == Some(0.0)));
    assert_eq!(relay.metric("orca_relay_invites_outstanding"), Some(0.0));
    let mut phone = ws_connect(&phone_url, None).unwrap();
    send_json(
        &mut phone,
        serde_json::json!({"type":"relay-auth","v":1,"credential":kept}),
    );
    assert_eq!(read_close(&mut phone), Some(4404), "the host is gone");
}

// ---------------------------------------------------------------------------------------------
// The HTTP port.

/// A thousand connections that withhold their bodies (a `POST /v1/assign` that stops half-way, a
/// `GET /health` that declares a body and sends none), reconnecting when closed, in a table of
/// 512: `/ready` and the director's feed poll are answered 200 every time.
#[test]
fn withheld_bodies_never_keep_ready_or_a_feed_poll_from_their_200() {
    const ATTACKERS: usize = 1000;
    let _ = orca_relay::lifecycle::raise_fd_limit();
    let relay = Relay::combined(&[
        ("ORCA_RELAY_HTTP_CONNECTIONS_MAX", "512"),
        ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
    ]);
    assert!(wait_until(Duration::from_secs(10), || relay
        .get("/ready")
        .0
        == 200));
    let stop = Arc::new(AtomicBool::new(false));
    let attack = {
        let addr = relay.http.clone();
        let stop = stop.clone();
        orca_relay::threads::spawn("test-withheld", move || {
            let request = |n: usize| -> Vec<u8> {
                if n.is_multiple_of(2) {
                    b"POST /v1/assign HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"v\":".to_vec()
                } else {
                    b"GET /health HTTP/1.1\r\nHost: r\r\nContent-Length: 60000\r\n\r\n".to_vec()
                }
            };
            let open = |n: usize| -> Option<TcpStream> {
                let mut stream = TcpStream::connect(&addr).ok()?;
                stream.write_all(&request(n)).ok()?;
                stream.set_nonblocking(true).ok()?;
                Some(stream)
            };
            let mut sockets: Vec<Option<TcpStream>> = (0..ATTACKERS).map(open).collect();
            let mut reconnects = 0u64;
            let mut sink = [0u8; 4096];
            while !stop.load(Ordering::Acquire) {
                for (n, slot) in sockets.iter_mut().enumerate() {
                    let closed = match slot {
                        Some(stream) => loop {
                            match stream.read(&mut sink) {
                                Ok(0) => break true,
                                Ok(_) => continue,
                                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                    break false
                                }
                                Err(_) => break true,
                            }
                        },
                        None => true,
                    };
                    if closed {
                        *slot = open(n);
                        reconnects += 1;
                    }
                }
                clock::sleep(Duration::from_millis(50));
            }
            reconnects
        })
        .unwrap()
    };
    // Let the attack fill the table.
    assert!(wait_until(Duration::from_secs(20), || {
        relay
            .metric("orca_relay_http_connections{state=\"waiting\"}")
            .unwrap_or(0.0)
            + relay
                .metric("orca_relay_http_connections{state=\"serving\"}")
                .unwrap_or(0.0)
            >= 500.0
    }));
    let mut latencies = Vec::new();
    for n in 0..60u32 {
        let (path, bearer) = if n.is_multiple_of(2) {
            ("/ready", None)
        } else {
            ("/internal/seats?reserver=1", Some(SERVICE_TOKEN))
        };
        let started = clock::instant();
        let mut conn = Conn::connect(&relay.http);
        let mut request = format!("GET {path} HTTP/1.1\r\nHost: relay\r\n");
        if let Some(token) = bearer {
            request.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        request.push_str("\r\n");
        conn.send(request.as_bytes()).unwrap();
        let answer = conn.read_response(Duration::from_secs(10));
        let took = started.elapsed();
        assert_eq!(
            answer.as_ref().map(|r| r.status).ok(),
            Some(200),
            "{path} under attack: {answer:?} after {took:?}"
        );
        latencies.push(took);
        clock::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Release);
    let reconnects = attack.join().unwrap();
    latencies.sort();
    let median = latencies[latencies.len() / 2];
    let p90 = latencies[latencies.len() * 9 / 10];
    eprintln!(
        "probes: median {median:?} p90 {p90:?} max {:?}; attacker reconnects {reconnects}",
        latencies.last().unwrap()
    );
    // The figure the issue sets (50 ms) as a median, so that a loaded CI machine cannot break
    // it; the bench (`cargo bench --bench http_edge`) holds the p99 to it.
    assert!(median <= Duration::from_millis(50), "median {median:?}");
}

/// `GET /health` that declares a 10-byte body and sends 3 is answered at once, then closed after
/// a short wait for the rest (RFC 9112 §9.3: the answer does not wait for an unread body).
#[test]
fn an_answer_comes_before_the_unread_body_is_discarded() {
    let relay = Relay::combined(&[]);
    let mut conn = Conn::connect(&relay.http);
    let started = clock::instant();
    conn.send(b"GET /health HTTP/1.1\r\nHost: relay\r\nContent-Length: 10\r\n\r\nabc")
        .unwrap();
    let answer = conn.read_response(Duration::from_secs(15)).unwrap();
    let answered = started.elapsed();
    assert_eq!(answer.status, 200);
    assert!(
        answered < Duration::from_secs(1),
        "answered after {answered:?}"
    );
    assert_eq!(conn.wait_closed(Duration::from_secs(15)), Ok(()));
    let closed = started.elapsed();
    eprintln!("answered after {answered:?}, closed after {closed:?}");
    assert!(closed < Duration::from_secs(3), "closed after {closed:?}");
    // A small body that does arrive is discarded and the connection kept.
    let mut conn = Conn::connect(&relay.http);
    conn.send(b"GET /health HTTP/1.1\r\nHost: relay\r\nContent-Length: 3\r\n\r\nabcGET /health HTTP/1.1\r\nHost: relay\r\n\r\n")
        .unwrap();
    for n in 0..2 {
        let answer = conn.read_response(Duration::from_secs(5)).unwrap();
        assert_eq!(answer.status, 200, "request {n}");
    }
}

/// `://` in the query is not an absolute-form target: `GET /v1/assign?u=://x/metrics` is not
/// served as `/metrics` (a front proxy that allows `/v1/assign` and denies `/metrics` by location
/// stays in charge); a real absolute-form target is parsed as scheme, authority, path.
#[test]
fn a_scheme_separator_in_the_query_never_reroutes_a_request() {
    let relay = Relay::combined(&[]);
    let get = |target: &str| {
        let mut conn = Conn::connect(&relay.http);
        conn.send(format!("GET {target} HTTP/1.1\r\nHost: relay\r\n\r\n").as_bytes())
            .unwrap();
        conn.read_response(Duration::from_secs(5)).unwrap()
    };
    for target in [
        "/v1/assign?u=://x/metrics",
        "/v1/admin/cells?u=://x/metrics",
        "/health?x=http://x/metrics",
    ] {
        let answer = get(target);
        let body = answer.body_text();
        eprintln!("{target} -> {} {body}", answer.status);
        assert!(
            !body.contains("orca_relay_"),
            "{target} was served as /metrics"
        );
    }
    assert_eq!(get("/health?x=http://x/metrics").status, 200);
    // A real absolute-form target: its path is served.
    let metrics = get("http://relay/metrics?x=1");
    assert_eq!(metrics.status, 200);
    assert!(metrics.body_text().contains("orca_relay_"));
    // Neither origin form nor absolute form: 400.
    assert_eq!(get("health").status, 400);
    assert_eq!(get("x://").status, 400);
}

/// RFC 9112 on the HTTP port: `Host` is required once on HTTP/1.1 (§3.2), a request line over
/// the limit is 414 (not 431), `Expect: 100-continue` means nothing on HTTP/1.0.
#[test]
fn the_http_port_keeps_the_host_request_line_and_expect_rules() {
    let relay = Relay::combined(&[]);
    let status = |bytes: &[u8]| raw_exchange(&relay.http, bytes).map(|(status, _)| status);
    assert_eq!(
        status(b"GET /health HTTP/1.1\r\n\r\n"),
        Some(400),
        "no Host"
    );
    assert_eq!(
        status(b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
        Some(400),
        "two Hosts"
    );
    assert_eq!(
        status(b"GET /health HTTP/1.0\r\n\r\n"),
        Some(200),
        "1.0 needs none"
    );
    assert_eq!(
        status(b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n"),
        Some(200)
    );
    let long_line = format!(
        "GET /health?{} HTTP/1.1\r\nHost: relay\r\n\r\n",
        "a".repeat(9000)
    );
    assert_eq!(status(long_line.as_bytes()), Some(414), "long request line");
    let long_header = format!(
        "GET /health HTTP/1.1\r\nHost: relay\r\nX-Big: {}\r\n\r\n",
        "a".repeat(9000)
    );
    assert_eq!(
        status(long_header.as_bytes()),
        Some(431),
        "large header block"
    );
    // HTTP/1.0 with Expect: no interim 100, the answer once the body is there.
    let mut stream = TcpStream::connect(&relay.http).unwrap();
    stream
        .write_all(b"POST /v1/assign HTTP/1.0\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut early = [0u8; 64];
    let got = stream.read(&mut early);
    assert!(
        !matches!(got, Ok(n) if n > 0 && early[..n].starts_with(b"HTTP/1.1 100")),
        "100 Continue sent to an HTTP/1.0 client"
    );
}

/// RFC 6455 §4.2 on the WebSocket port: the key is base64 of 16 bytes, HTTP/1.1 and GET are
/// required, a missing or wrong version is 426 with `Sec-WebSocket-Version: 13`, and a malformed
/// head is answered 400 before the close.
#[test]
fn the_upgrade_checks_its_key_version_and_method_and_answers_every_bad_head() {
    let relay = Relay::combined(&[]);
    let ws = relay.ws.clone();
    let answer = |bytes: String| raw_exchange(&ws, bytes.as_bytes());
    let phone = "/v1/connect/abcdefghijklmnop";
    let with_key = |key: &str| {
        format!(
            "GET {phone} HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n\r\n"
        )
    };
    for key in [
        "",
        "not base64 at all",
        "AAAAAAAAAAAAAAAAAAAA",
        "AAAAAAAAAAAAAAAAAAAAAAAAAA==",
    ] {
        assert_eq!(
            answer(with_key(key)).map(|(s, _)| s),
            Some(400),
            "key {key:?}"
        );
    }
    let no_key = format!(
        "GET {phone} HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    assert_eq!(answer(no_key).map(|(s, _)| s), Some(400), "no key");
    let http10 = upgrade_request(phone, "").replace("HTTP/1.1", "HTTP/1.0");
    assert_eq!(answer(http10).map(|(s, _)| s), Some(400), "HTTP/1.0");
    let post = upgrade_request(phone, "").replacen("GET", "POST", 1);
    assert_eq!(answer(post).map(|(s, _)| s), Some(400), "POST");
    assert_eq!(
        answer("BLAH\r\n\r\n".to_string()).map(|(s, _)| s),
        Some(400),
        "malformed head"
    );
    let long_line = format!(
        "GET {phone}?{} HTTP/1.1\r\nHost: relay\r\n\r\n",
        "a".repeat(9000)
    );
    assert_eq!(answer(long_line).map(|(s, _)| s), Some(414), "long line");
    let no_host = upgrade_request(phone, "").replace("Host: relay\r\n", "");
    assert_eq!(answer(no_host).map(|(s, _)| s), Some(400), "no Host");
    // Not an upgrade, or another version: 426 that names the version we speak.
    for request in [
        format!("GET {phone} HTTP/1.1\r\nHost: relay\r\n\r\n"),
        upgrade_request(phone, "").replace("Version: 13", "Version: 8"),
    ] {
        let (status, head) = answer(request.clone()).expect("an answer");
        assert_eq!(status, 426, "{request}");
        assert!(
            head.to_ascii_lowercase()
                .contains("sec-websocket-version: 13\r\n"),
            "{head}"
        );
    }
    // The valid request still upgrades.
    assert_eq!(
        answer(upgrade_request(phone, "")).map(|(s, _)| s),
        Some(101)
    );
}

/// Unauthenticated requests to `/internal/*` and `/v1/admin/*` are counted, and logged once,
/// then at most once a minute with a count, not a line each.
#[test]
fn refused_api_requests_are_counted_and_their_lines_throttled() {
    const REQUESTS: usize = 300;
    let relay = Relay::combined(&[("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN)]);
    for path in ["/internal/seats", "/v1/admin/cells"] {
        let mut conn = Conn::connect(&relay.http);
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer wrong\r\n\r\n");
        conn.send(request.repeat(REQUESTS).as_bytes()).unwrap();
        for n in 0..REQUESTS {
            let answer = conn.read_response(Duration::from_secs(10)).unwrap();
            assert_eq!(answer.status, 401, "{path} request {n}");
        }
    }
    let counted = |series: &str| relay.metric(series).unwrap_or(0.0);
    assert_eq!(
        counted("orca_relay_cell_internal_unauthorized_total"),
        REQUESTS as f64
    );
    assert_eq!(
        counted("orca_relay_director_admin_requests_total{route=\"cells\",status=\"401\"}"),
        REQUESTS as f64
    );
    let lines = relay.count_log("unauthorized");
    assert!(
        lines <= 4,
        "{lines} log lines for {} refusals",
        2 * REQUESTS
    );
    // `Bearer` is a case-insensitive scheme (RFC 9110 §11.1).
    let (status, _) = http_get_with(
        &relay,
        "/internal/seats",
        &format!("bearer {SERVICE_TOKEN}"),
    );
    assert_eq!(status, 200);
    let (status, _) = http_get_with(
        &relay,
        "/internal/seats",
        &format!("BEARER {SERVICE_TOKEN}"),
    );
    assert_eq!(status, 200);
}

fn http_get_with(relay: &Relay, path: &str, authorization: &str) -> (u16, String) {
    let mut conn = Conn::connect(&relay.http);
    conn.send(
        format!("GET {path} HTTP/1.1\r\nHost: relay\r\nAuthorization: {authorization}\r\n\r\n")
            .as_bytes(),
    )
    .unwrap();
    let answer = conn.read_response(Duration::from_secs(10)).unwrap();
    (answer.status, answer.body_text())
}
