//! Black-box tests of issue 18 on the combined role (the real binary, real sockets): the splice
//! workers lose no frame and stay bounded under any peer (pings after data under backpressure,
//! ping floods, declared lengths, silence, slow readers), the two directions of a pair stay
//! independent, and the cell-wide threads (pinger, drain) never wait on one desktop's socket.
//! Independent scenarios are separate tests so that they run in parallel.

mod harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness::*;
use tungstenite::{Message, WebSocket};

// ---------------------------------------------------------------------------------------------
// Raw frames on a spliced leg.

/// A masked client frame (RFC 6455 §5.2).
fn client_frame(first: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    orca_relay::relay::frames::encode_client_frame(
        first,
        payload,
        [0x3c, 0x5a, 0xa5, 0xc3],
        &mut out,
    );
    out
}

/// The TCP stream under a harness WebSocket, its reads and writes retried when interrupted
/// (after `relay-hello`, nothing else is buffered in it: the relay sends nothing more until the
/// peer does).
fn raw(ws: &Ws) -> Stream {
    Stream(ws.get_ref().try_clone().expect("clone the stream"))
}

/// An incremental reader of unmasked server frames: (first header byte, payload).
#[derive(Default)]
struct ServerFrames {
    buf: Vec<u8>,
}

impl ServerFrames {
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    fn next(&mut self) -> Option<(u8, Vec<u8>)> {
        let second = *self.buf.get(1)?;
        let (head, len) = match second & 0x7f {
            126 => (
                4,
                u16::from_be_bytes(self.buf.get(2..4)?.try_into().ok()?) as usize,
            ),
            127 => (
                10,
                u64::from_be_bytes(self.buf.get(2..10)?.try_into().ok()?) as usize,
            ),
            short => (2, short as usize),
        };
        let payload = self.buf.get(head..head + len)?.to_vec();
        let first = self.buf[0];
        self.buf.drain(..head + len);
        Some((first, payload))
    }
}

/// The relay process's resident memory (`VmRSS`), in bytes.
fn rss(relay: &Relay) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", relay.pid())).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib * 1024
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[index]
}

// ---------------------------------------------------------------------------------------------
// Frames are never lost.

/// The issue's reproduction: a desktop streams 16 KiB frames to a phone that reads slowly,
/// while the phone sends a text frame and a ping in one write every 4 ms. Every text frame
/// reaches the desktop, in order, and the phone's latest ping is answered. (Before: a ping
/// answered from inside the phone's read flushed the phone's output and read the desktop's leg
/// from there, which cleared the phone's staged frames: 662 of 2,847 lost, silently.)
#[test]
fn data_and_a_ping_in_one_write_under_backpressure_deliver_every_frame() {
    const ROUNDS: u64 = 2_000;
    let relay = Relay::combined(&[("ORCA_RELAY_SPLICE_WORKERS", "1")]);
    let mut desktop = Desktop::connect(&relay);
    let (phone, leg) = splice(&relay, &mut desktop);
    let (phone_in, mut phone_out) = (raw(&phone), raw(&phone));
    let (mut leg_in, mut leg_out) = (raw(&leg), raw(&leg));
    leg_in
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));

    // The desktop streams 16 KiB binary frames as fast as the relay takes them.
    let streamer = {
        let stop = stop.clone();
        orca_relay::threads::spawn("test-desktop-stream", move || {
            let frame = client_frame(0x82, &[7u8; 16 * 1024]);
            while !stop.load(Ordering::Acquire) {
                if leg_out.write_all(&frame).is_err() {
                    break;
                }
            }
        })
        .unwrap()
    };
    // The phone reads slowly: 16 KiB every 2 ms, and keeps the pongs it gets.
    let pongs = Arc::new(Mutex::new(Vec::<Vec<u8>>::new()));
    let reader = {
        let (stop, pongs) = (stop.clone(), pongs.clone());
        let mut stream = phone_in;
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        orca_relay::threads::spawn("test-phone-slow-reader", move || {
            let mut frames = ServerFrames::default();
            let mut buf = vec![0u8; 16 * 1024];
            while !stop.load(Ordering::Acquire) {
                if let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    frames.push(&buf[..n]);
                    while let Some((first, payload)) = frames.next() {
                        if first == 0x8a {
                            pongs.lock().unwrap().push(payload);
                        }
                    }
                }
                orca_relay::clock::sleep(Duration::from_millis(2));
            }
        })
        .unwrap()
    };
    // The desktop's reader counts the phone's text frames.
    let received = Arc::new(AtomicU64::new(0));
    let counter = {
        let received = received.clone();
        orca_relay::threads::spawn("test-desktop-reader", move || {
            let mut frames = ServerFrames::default();
            let mut buf = vec![0u8; 64 * 1024];
            let mut next = 0u64;
            while next < ROUNDS {
                let n = match leg_in.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                frames.push(&buf[..n]);
                while let Some((first, payload)) = frames.next() {
                    if first == 0x81 {
                        let seq: u64 = String::from_utf8_lossy(&payload).parse().unwrap();
                        assert_eq!(seq, next, "text frame {next} lost or out of order");
                        next += 1;
                        received.store(next, Ordering::Release);
                    }
                }
            }
        })
        .unwrap()
    };
    for round in 0..ROUNDS {
        let mut write = client_frame(0x81, round.to_string().as_bytes());
        write.extend_from_slice(&client_frame(0x89, format!("ping-{round}").as_bytes()));
        phone_out.write_all(&write).unwrap();
        orca_relay::clock::sleep(Duration::from_millis(4));
    }
    let all = wait_until(Duration::from_secs(30), || {
        received.load(Ordering::Acquire) == ROUNDS
    });
    let last_ping = format!("ping-{}", ROUNDS - 1).into_bytes();
    let answered = wait_until(Duration::from_secs(30), || {
        pongs.lock().unwrap().last() == Some(&last_ping)
    });
    stop.store(true, Ordering::Release);
    let got = received.load(Ordering::Acquire);
    drop((phone, leg));
    let _ = streamer.join();
    let _ = reader.join();
    assert!(
        counter.join().is_ok(),
        "the desktop saw a frame lost or out of order"
    );
    assert!(all, "{got} of {ROUNDS} text frames arrived");
    assert!(answered, "the latest ping was never answered");
    let pongs = pongs.lock().unwrap().len();
    assert!(pongs <= ROUNDS as usize, "{pongs} pongs for {ROUNDS} pings");
}

/// The directions of a pair are independent: a phone that downloads a desktop's stream slowly
/// still gets each of its small upstream frames (keystrokes) to the desktop within 50 ms.
#[test]
fn a_phone_that_reads_its_download_slowly_still_gets_its_input_through_at_once() {
    let relay = Relay::combined(&[("ORCA_RELAY_WEDGE_MS", "60000")]);
    let mut desktop = Desktop::connect(&relay);
    let (phone, leg) = splice(&relay, &mut desktop);
    let (mut phone_in, mut phone_out) = (raw(&phone), raw(&phone));
    let (mut leg_in, mut leg_out) = (raw(&leg), raw(&leg));
    let stop = Arc::new(AtomicBool::new(false));
    // The desktop streams screen updates; the phone reads 4 KiB every 20 ms (200 KB/s).
    let streamer = {
        let stop = stop.clone();
        orca_relay::threads::spawn("test-screen-stream", move || {
            let frame = client_frame(0x82, &[1u8; 64 * 1024]);
            while !stop.load(Ordering::Acquire) {
                if leg_out.write_all(&frame).is_err() {
                    break;
                }
            }
        })
        .unwrap()
    };
    let slow = {
        let stop = stop.clone();
        phone_in
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        orca_relay::threads::spawn("test-slow-download", move || {
            let mut buf = [0u8; 4096];
            while !stop.load(Ordering::Acquire) {
                if let Ok(0) = phone_in.read(&mut buf) {
                    break;
                }
                orca_relay::clock::sleep(Duration::from_millis(20));
            }
        })
        .unwrap()
    };
    // Let the download back up: the relay's output to the phone reaches its bound.
    orca_relay::clock::sleep(Duration::from_secs(2));
    leg_in
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut frames = ServerFrames::default();
    let mut buf = [0u8; 1024];
    let mut delays = Vec::with_capacity(100);
    for key in 0..100u32 {
        let sent = orca_relay::clock::instant();
        phone_out
            .write_all(&client_frame(0x81, format!("key-{key}").as_bytes()))
            .unwrap();
        let got = loop {
            if let Some(frame) = frames.next() {
                break frame;
            }
            let n = leg_in.read(&mut buf).expect("the keystroke never arrived");
            frames.push(&buf[..n]);
        };
        assert_eq!(got, (0x81, format!("key-{key}").into_bytes()));
        delays.push(sent.elapsed());
        orca_relay::clock::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Release);
    drop((phone, leg));
    let _ = streamer.join();
    let _ = slow.join();
    // Each keystroke within 50 ms; on a loaded machine (CI runs beside busy loops) a few may
    // lose a scheduling slice, so up to 5 of 100 may be late, none by a second. A leg paused
    // by its own output never gets a keystroke through at all (the read above times out).
    delays.sort();
    let late = delays
        .iter()
        .filter(|delay| **delay > Duration::from_millis(50))
        .count();
    let worst = delays.last().copied().unwrap_or_default();
    assert!(
        late <= 5 && worst < Duration::from_secs(1),
        "{late} of 100 keystrokes over 50 ms behind the download (median {:?}, worst {worst:?})",
        delays[delays.len() / 2]
    );
}

// ---------------------------------------------------------------------------------------------
// Ping floods.

/// A phone floods pings (2,000 of them every 5 ms, reading its pongs); another pair on the
/// same worker keeps its round-trip p99 within twice what it was with no flood.
#[test]
fn a_ping_flood_keeps_another_pair_on_its_worker_within_twice_its_idle_p99() {
    let relay = Relay::combined(&[("ORCA_RELAY_SPLICE_WORKERS", "1")]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, mut leg) = splice(&relay, &mut desktop);
    let (flooder, flood_leg) = splice(&relay, &mut desktop);
    let mut round_trips = |count: usize| -> Vec<Duration> {
        let mut samples = Vec::with_capacity(count);
        let deadline = orca_relay::clock::instant() + Duration::from_secs(30);
        for i in 0..count {
            assert!(
                orca_relay::clock::instant() < deadline,
                "{i} of {count} round trips in 30 s (last {:?})",
                samples.last()
            );
            let started = orca_relay::clock::instant();
            phone.send(Message::binary(vec![i as u8; 64])).unwrap();
            let got = leg.read().unwrap();
            leg.send(got).unwrap();
            phone.read().unwrap();
            samples.push(started.elapsed());
        }
        samples
    };
    round_trips(200);
    let idle_p99 = percentile(&mut round_trips(1_500), 0.99);

    let stop = Arc::new(AtomicBool::new(false));
    let (mut flood_in, mut flood_out) = (raw(&flooder), raw(&flooder));
    let pongs = Arc::new(AtomicU64::new(0));
    let flood = {
        let stop = stop.clone();
        orca_relay::threads::spawn("test-ping-flood", move || {
            let ping = client_frame(0x89, b"");
            let burst: Vec<u8> = ping
                .iter()
                .copied()
                .cycle()
                .take(ping.len() * 2_000)
                .collect();
            while !stop.load(Ordering::Acquire) {
                if flood_out.write_all(&burst).is_err() {
                    break;
                }
                orca_relay::clock::sleep(Duration::from_millis(5));
            }
        })
        .unwrap()
    };
    let flood_reader = {
        let (stop, pongs) = (stop.clone(), pongs.clone());
        flood_in
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        orca_relay::threads::spawn("test-pong-reader", move || {
            let mut buf = vec![0u8; 64 * 1024];
            while !stop.load(Ordering::Acquire) {
                if let Ok(n) = flood_in.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    pongs.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .unwrap()
    };
    orca_relay::clock::sleep(Duration::from_millis(300));
    let flood_p99 = percentile(&mut round_trips(1_500), 0.99);
    stop.store(true, Ordering::Release);
    let _ = flood.join();
    let _ = flood_reader.join();
    drop((flooder, flood_leg));
    assert!(pongs.load(Ordering::Relaxed) > 0, "the flooder got no pong");
    // A 5 ms floor under the idle figure. The flooded worker is busy, where the idle one
    // sleeps and wakes at once: with a busy loop per core beside the suite, the scheduler lets
    // each busy loop run its slice (3 ms) before the worker, and a p99 of 0.48 ms idle came out
    // at 4.2 ms under the flood. The defect this guards against (a ping flood starving the
    // worker) took the other pair to 1,442 ms.
    let allowed = 2 * idle_p99.max(Duration::from_millis(5));
    assert!(
        flood_p99 <= allowed,
        "p99 {flood_p99:?} under the flood, {idle_p99:?} without"
    );
}

/// Issue 30: a phone that sends pings as fast as its socket takes them (minimal 6-byte pings,
/// so the worker always has a full read of them waiting) gets 64 parsed per turn of the
/// worker, and another pair on the same worker keeps its round trips. Without the per-turn
/// budget a turn of the flooder is 16 reads of 256 KiB, 700,000 pings, and the other pair
/// waits behind each one. Judged on the median, which the machine's load barely moves.
#[test]
fn a_ping_flood_at_full_speed_leaves_another_pair_its_round_trips() {
    let relay = Relay::combined(&[
        ("ORCA_RELAY_SPLICE_WORKERS", "1"),
        ("ORCA_RELAY_WEDGE_MS", "600000"),
    ]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, mut leg) = splice(&relay, &mut desktop);
    let (flooder, flood_leg) = splice(&relay, &mut desktop);
    // Each round trip takes tens of microseconds; without the budget about a second.
    let mut round_trips = |count: usize| -> Vec<Duration> {
        let mut samples = Vec::with_capacity(count);
        let deadline = orca_relay::clock::instant() + Duration::from_secs(20);
        for i in 0..count {
            assert!(
                orca_relay::clock::instant() < deadline,
                "{i} of {count} round trips in 20 s (last {:?})",
                samples.last()
            );
            let started = orca_relay::clock::instant();
            phone.send(Message::binary(vec![i as u8; 64])).unwrap();
            let got = leg.read().unwrap();
            leg.send(got).unwrap();
            phone.read().unwrap();
            samples.push(started.elapsed());
        }
        samples
    };
    round_trips(100);
    let idle = round_trips(300);

    let stop = Arc::new(AtomicBool::new(false));
    let (mut flood_in, mut flood_out) = (raw(&flooder), raw(&flooder));
    let flood = {
        let stop = stop.clone();
        orca_relay::threads::spawn("test-ping-flood", move || {
            let ping = client_frame(0x89, b"");
            let burst: Vec<u8> = ping
                .iter()
                .copied()
                .cycle()
                .take(ping.len() * 100_000)
                .collect();
            flood_out
                .set_write_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            while !stop.load(Ordering::Acquire) {
                // A write the relay does not take in time is backpressure: write again.
                let _ = flood_out.write_all(&burst);
            }
        })
        .unwrap()
    };
    let pongs = {
        let stop = stop.clone();
        flood_in
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        orca_relay::threads::spawn("test-pong-reader", move || {
            let mut buf = vec![0u8; 64 * 1024];
            let mut bytes = 0u64;
            while !stop.load(Ordering::Acquire) {
                match flood_in.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => bytes += n as u64,
                    Err(_) => {}
                }
            }
            bytes
        })
        .unwrap()
    };
    orca_relay::clock::sleep(Duration::from_millis(500));
    let flooded = round_trips(300);
    stop.store(true, Ordering::Release);
    let _ = flood.join();
    let pong_bytes = pongs.join().unwrap();
    drop((flooder, flood_leg));
    let (mut idle, mut flooded) = (idle, flooded);
    let idle_median = percentile(&mut idle, 0.5);
    let flooded_median = percentile(&mut flooded, 0.5);
    assert!(pong_bytes > 0, "the flooder got no pong");
    // Measured: 34 µs idle, 80 µs under the flood; 0.8-1.4 s without the budget. The floor
    // leaves a loaded machine's scheduler two orders of magnitude.
    let allowed = Duration::from_millis(20).max(4 * idle_median);
    assert!(
        flooded_median <= allowed,
        "median round trip {flooded_median:?} under the flood, {idle_median:?} without"
    );
}

/// A phone that sends pings as fast as it can and reads nothing: the relay owes it one pong at
/// a time, so its memory stays flat (within 2 MiB over 20 s), and the leg stays open.
#[test]
fn a_ping_flood_that_reads_nothing_costs_at_most_one_pending_pong() {
    let relay = Relay::combined(&[("ORCA_RELAY_WEDGE_MS", "600000")]);
    let mut desktop = Desktop::connect(&relay);
    let (flooder, leg) = splice(&relay, &mut desktop);
    let mut out = raw(&flooder);
    out.set_write_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let ping = client_frame(0x89, &[b'p'; 125]);
    let burst: Vec<u8> = ping
        .iter()
        .copied()
        .cycle()
        .take(ping.len() * 512)
        .collect();
    let flood_for = |duration: Duration, out: &mut Stream| {
        let until = orca_relay::clock::instant() + duration;
        while orca_relay::clock::instant() < until {
            // The relay stops reading it once its socket is full: a write that times out is
            // that backpressure, not a failure.
            let _ = out.write_all(&burst);
        }
    };
    flood_for(Duration::from_secs(3), &mut out);
    let before = rss(&relay);
    let mut peak = before;
    for _ in 0..20 {
        flood_for(Duration::from_secs(1), &mut out);
        peak = peak.max(rss(&relay));
    }
    assert!(
        peak <= before + 2 * 1024 * 1024,
        "RSS grew from {before} to {peak} bytes under a ping flood that reads nothing"
    );
    // Still open: once it reads, it gets pongs (one per turn of the worker at most).
    let mut input = raw(&flooder);
    input
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = input.read(&mut buf).expect("the leg is still served");
    assert!(
        n > 0 && buf[0] == 0x8a,
        "a pong first, got {:x?}",
        &buf[..n.min(8)]
    );
    drop((flooder, leg));
}

// ---------------------------------------------------------------------------------------------
// Memory follows the bytes that arrived.

/// Legs that declare 8 MiB frames and send one byte of them cost no more than what arrived:
/// under 64 KiB each (32 legs, RSS measured). Before: the declared length was zero-filled up
/// front, 8 MiB each.
#[test]
fn a_declared_8_mib_frame_with_one_byte_sent_costs_under_64_kib() {
    const LEGS: u64 = 32;
    let relay = Relay::combined(&[("ORCA_RELAY_WEDGE_MS", "600000")]);
    // Eight phones per desktop at most.
    let mut desktops: Vec<Desktop> = (0..LEGS / 8).map(|_| Desktop::connect(&relay)).collect();
    let mut pairs: Vec<_> = (0..LEGS as usize)
        .map(|i| splice(&relay, &mut desktops[i / 8]))
        .collect();
    // Warm up the worker's buffers with one large frame through one pair.
    let (phone, leg) = &mut pairs[0];
    phone.send(Message::binary(vec![9u8; 300 * 1024])).unwrap();
    assert_eq!(leg.read().unwrap().len(), 300 * 1024);
    orca_relay::clock::sleep(Duration::from_millis(300));
    let before = rss(&relay);
    let mut header = vec![0x82, 0xff];
    header.extend_from_slice(&(8u64 * 1024 * 1024).to_be_bytes());
    header.extend_from_slice(&[1, 2, 3, 4]);
    // The 14-byte header, then (in a later read) one byte of payload.
    for (phone, _) in &pairs {
        raw(phone).write_all(&header).unwrap();
    }
    orca_relay::clock::sleep(Duration::from_millis(200));
    for (phone, _) in &pairs {
        raw(phone).write_all(&[0x55]).unwrap();
    }
    // Let the worker read them all.
    orca_relay::clock::sleep(Duration::from_millis(500));
    let after = rss(&relay);
    let per_leg = after.saturating_sub(before) / LEGS;
    assert!(
        per_leg < 64 * 1024,
        "{per_leg} bytes per leg (RSS {before} -> {after})"
    );
    // The frames are still honoured: one of them completed arrives whole.
    let (phone, leg) = &mut pairs[1];
    let rest = vec![0x55 ^ 2; 8 * 1024 * 1024 - 1];
    let mut masked = rest.clone();
    for (i, byte) in masked.iter_mut().enumerate() {
        *byte = rest[i] ^ [1, 2, 3, 4][(i + 1) % 4];
    }
    raw(phone).write_all(&masked).unwrap();
    let got = leg.read().unwrap();
    assert_eq!(got.len(), 8 * 1024 * 1024);
}

/// A 64 KiB frame whose payload is still arriving is forwarded as it arrives (its header and
/// the part that came go to the peer at once, instead of a copy kept until the frame is
/// whole), and the frame the peer reads is byte-exact; a small frame after it is unharmed.
/// (Before: a frame that fit the read buffer was kept whole, and nothing of it reached the
/// peer until its last byte arrived.)
#[test]
fn a_large_frame_is_forwarded_as_it_arrives() {
    const FRAME: usize = 64 * 1024;
    const FIRST: usize = 20 * 1024;
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let (phone, leg) = splice(&relay, &mut desktop);
    let mut leg_in = raw(&leg);
    leg_in
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let payload: Vec<u8> = (0..FRAME).map(|i| (i * 31 % 251) as u8).collect();
    let frame = client_frame(0x82, &payload);
    let head = frame.len() - FRAME;
    let mut phone_out = raw(&phone);
    phone_out.write_all(&frame[..head + FIRST]).unwrap();
    // The header (4 bytes for this length) and the first part reach the desktop while the
    // rest has not been sent.
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let arrived = wait_until(Duration::from_secs(10), || {
        match leg_in.read(&mut buf) {
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ),
                "desktop read: {e}"
            ),
        }
        got.len() >= 4 + FIRST
    });
    assert!(
        arrived,
        "only {} of the frame's first {} bytes reached the desktop before its rest was sent",
        got.len(),
        4 + FIRST
    );
    phone_out.write_all(&frame[head + FIRST..]).unwrap();
    phone_out.write_all(&client_frame(0x81, b"after")).unwrap();
    let mut frames = ServerFrames::default();
    frames.push(&got);
    let mut seen = Vec::new();
    let complete = wait_until(Duration::from_secs(10), || {
        while let Some(frame) = frames.next() {
            seen.push(frame);
        }
        if seen.len() >= 2 {
            return true;
        }
        if let Ok(n) = leg_in.read(&mut buf) {
            frames.push(&buf[..n]);
        }
        false
    });
    assert!(complete, "{} frames reached the desktop", seen.len());
    assert_eq!(seen[0].0, 0x82);
    assert!(seen[0].1 == payload, "the streamed frame is not byte-exact");
    assert_eq!(seen[1], (0x81, b"after".to_vec()));
}

// ---------------------------------------------------------------------------------------------
// Silence.

/// With `ORCA_RELAY_SPLICE_IDLE_MS=2000`: a pair whose endpoints send nothing and answer no
/// ping (they never read) is closed 4408 at the idle timeout and frees its two units and the
/// phone's place, while a pair whose endpoints only ping stays open.
#[test]
fn a_silent_pair_is_closed_at_the_idle_timeout_and_a_pinging_pair_stays() {
    let relay = Relay::combined(&[("ORCA_RELAY_SPLICE_IDLE_MS", "2000")]);
    let mut desktop = Desktop::connect(&relay);
    let units_before = relay.metric("orca_relay_connection_units").unwrap();
    let (silent_phone, silent_leg) = splice(&relay, &mut desktop);
    let (pinging_phone, pinging_leg) = splice(&relay, &mut desktop);
    assert_eq!(
        relay.metric("orca_relay_connection_units"),
        Some(units_before + 4.0)
    );
    let stop = Arc::new(AtomicBool::new(false));
    let pinger = {
        let stop = stop.clone();
        let mut ends = [raw(&pinging_phone), raw(&pinging_leg)];
        orca_relay::threads::spawn("test-keepalive", move || {
            while !stop.load(Ordering::Acquire) {
                for end in ends.iter_mut() {
                    let _ = end.write_all(&client_frame(0x89, b"keepalive"));
                }
                orca_relay::clock::sleep(Duration::from_millis(500));
            }
        })
        .unwrap()
    };
    let started = orca_relay::clock::instant();
    // The silent pair: closed 4408 on both legs, after the idle window and not long after.
    let mut phone_in = raw(&silent_phone);
    let mut leg_in = raw(&silent_leg);
    let close_of = |stream: &mut Stream| -> Option<u16> {
        stream
            .set_read_timeout(Some(Duration::from_secs(15)))
            .unwrap();
        let mut frames = ServerFrames::default();
        let mut buf = [0u8; 1024];
        loop {
            while let Some((first, payload)) = frames.next() {
                if first == 0x88 {
                    return Some(u16::from_be_bytes([payload[0], payload[1]]));
                }
            }
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => return None,
                Ok(n) => frames.push(&buf[..n]),
            }
        }
    };
    assert_eq!(close_of(&mut phone_in), Some(4408));
    assert_eq!(close_of(&mut leg_in), Some(4408));
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(1_900),
        "closed before the idle window: {elapsed:?}"
    );
    // Units and the phone's place come back (8 places: 7 more phones can join).
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connection_units")
        == Some(units_before + 2.0)));
    let extra: Vec<_> = (0..7).map(|_| splice(&relay, &mut desktop)).collect();
    // The pinging pair is still open and carries data.
    stop.store(true, Ordering::Release);
    let _ = pinger.join();
    let (mut phone, mut leg) = (pinging_phone, pinging_leg);
    phone.send(Message::text("still here")).unwrap();
    let got = loop {
        match leg.read().unwrap() {
            Message::Text(text) => break text,
            _ => continue,
        }
    };
    assert_eq!(got.as_str(), "still here");
    drop(extra);
    drop((silent_phone, silent_leg));
}

/// A desktop streaming to a phone that downloads slowly is paused for longer than the idle
/// window (the phone's output is at its bound): what the desktop sends, the answer to the
/// relay's ping included, waits unread in the kernel, so its silence cannot be judged. Both ends
/// are alive (the phone pings, the desktop writes): the pair is not closed as silent.
#[test]
fn a_desktop_paused_by_a_slow_download_is_not_closed_as_silent() {
    let relay = Relay::combined(&[
        ("ORCA_RELAY_SPLICE_IDLE_MS", "1500"),
        ("ORCA_RELAY_WEDGE_MS", "60000"),
    ]);
    let mut desktop = Desktop::connect(&relay);
    let (phone, leg) = splice(&relay, &mut desktop);
    let (mut phone_in, mut phone_out) = (raw(&phone), raw(&phone));
    let mut leg_out = raw(&leg);
    let stop = Arc::new(AtomicBool::new(false));
    let streamer = {
        let stop = stop.clone();
        orca_relay::threads::spawn("test-screen-stream", move || {
            let frame = client_frame(0x82, &[1u8; 64 * 1024]);
            leg_out
                .set_write_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            while !stop.load(Ordering::Acquire) {
                match leg_out.write(&frame) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => break,
                }
            }
        })
        .unwrap()
    };
    // The phone reads 1 KiB every 100 ms and pings every 500 ms: alive, but slow.
    let phone_end = {
        let stop = stop.clone();
        phone_in
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        orca_relay::threads::spawn("test-slow-phone", move || {
            let mut buf = [0u8; 1024];
            let mut last_ping = orca_relay::clock::instant();
            while !stop.load(Ordering::Acquire) {
                if let Ok(0) = phone_in.read(&mut buf) {
                    break;
                }
                if last_ping.elapsed() >= Duration::from_millis(500) {
                    last_ping = orca_relay::clock::instant();
                    let _ = phone_out.write_all(&client_frame(0x89, b"keepalive"));
                }
                orca_relay::clock::sleep(Duration::from_millis(100));
            }
        })
        .unwrap()
    };
    let idle = relay.wait_for_log("orca_relay_splice_idle", Duration::from_secs(5));
    stop.store(true, Ordering::Release);
    let _ = streamer.join();
    let _ = phone_end.join();
    drop((phone, leg));
    assert!(idle.is_none(), "a live pair was closed as silent: {idle:?}");
}

/// A desktop's control leaves (no newer one takes its place): each of its spliced pairs is
/// closed 4408 and frees its phone's place.
#[test]
fn pairs_of_a_desktop_whose_control_leaves_are_closed_4408() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, mut leg) = splice(&relay, &mut desktop);
    drop(desktop);
    assert_eq!(read_close(&mut phone), Some(4408));
    assert_eq!(read_close(&mut leg), Some(4408));
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connection_units")
        == Some(0.0)));
}

// ---------------------------------------------------------------------------------------------
// A slow large frame (issue 30): the idle clock counts the relay's writes that make progress.

/// How fast the slow phone reads: 100 KB/s, in 2 KiB reads.
const SLOW_PHONE_BYTES_PER_S: u64 = 100_000;
const SLOW_PHONE_READ: usize = 2 * 1024;

/// A phone's TCP stream that reads at [`SLOW_PHONE_BYTES_PER_S`] once [`Paced::pace`] starts
/// it (a phone on a slow mobile link): each read takes at most [`SLOW_PHONE_READ`] bytes and
/// waits for its turn. Writes (its pongs) go out at once.
struct Paced {
    stream: Stream,
    since: Option<std::time::Instant>,
    taken: u64,
}

impl Paced {
    fn pace(&mut self) {
        self.since = Some(orca_relay::clock::instant());
        self.taken = 0;
    }
}

impl Read for Paced {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut want = buf.len().min(SLOW_PHONE_READ);
        if let Some(since) = self.since {
            // The next read is due once the rate has paid for the bytes already taken.
            let due =
                since + Duration::from_micros(self.taken * 1_000_000 / SLOW_PHONE_BYTES_PER_S);
            let now = orca_relay::clock::instant();
            if due > now {
                orca_relay::clock::sleep(due - now);
            }
        } else {
            want = buf.len();
        }
        let n = self.stream.read(&mut buf[..want])?;
        self.taken += n as u64;
        Ok(n)
    }
}

impl Write for Paced {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// A TCP connection to the relay's WebSocket listener with a small receive buffer and small
/// segments, set before the connect (so the window and the relay's send buffer are sized for
/// them): only a few KiB of what the relay writes wait in the kernel, the rest in the relay's
/// output, as on a slow mobile link.
fn small_buffer_connection(relay: &Relay) -> TcpStream {
    // SAFETY: a plain socket(2); the descriptor is owned by the TcpStream made from it below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    assert!(fd >= 0);
    for (level, option, value) in [
        (libc::SOL_SOCKET, libc::SO_RCVBUF, 4096),
        (libc::IPPROTO_TCP, libc::TCP_MAXSEG, 536),
    ] {
        let value: libc::c_int = value;
        // SAFETY: setsockopt reads one int from a local.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                option,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    let addr: std::net::SocketAddrV4 = relay.ws.parse().unwrap();
    let sockaddr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: connect reads a sockaddr_in we own.
    let connected = unsafe {
        libc::connect(
            fd,
            (&sockaddr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    assert_eq!(connected, 0, "{}", std::io::Error::last_os_error());
    // SAFETY: fd is a connected socket nobody else owns.
    let stream = unsafe { <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    stream.set_nodelay(true).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream
}

/// A slow phone (a [`small_buffer_connection`] read through [`Paced`], a plain WebSocket client
/// that answers pings) spliced to a data leg of `desktop`: (phone, data leg).
fn slow_splice(relay: &Relay, desktop: &mut Desktop) -> (WebSocket<Paced>, Ws) {
    use tungstenite::client::IntoClientRequest;
    let invite = desktop.invite();
    let request = relay
        .ws_url(&format!("/v1/connect/{}", desktop.relay_host_id))
        .into_client_request()
        .unwrap();
    let paced = Paced {
        stream: Stream(small_buffer_connection(relay)),
        since: None,
        taken: 0,
    };
    let (mut phone, _) = tungstenite::client(request, paced).expect("phone upgrade");
    phone
        .send(Message::text(
            serde_json::json!({"type":"relay-auth","v":1,"credential":invite}).to_string(),
        ))
        .unwrap();
    let (conn_id, ticket) = desktop.conn_open();
    let leg = desktop.data_leg(relay, &conn_id, &ticket);
    match phone.read().unwrap() {
        Message::Text(text) => assert_eq!(text.as_str(), r#"{"type":"relay-hello","ok":true}"#),
        other => panic!("phone: {other:?} before relay-hello"),
    }
    (phone, leg)
}

/// A desktop data leg on its own thread: sends `messages`, then reads (answering the relay's
/// pings, as any client does) until `stop` or for at most `within`; returns the close code it
/// got, if any, and when.
fn desktop_sending(
    mut leg: Ws,
    messages: Vec<Message>,
    stop: Arc<AtomicBool>,
    within: Duration,
) -> std::thread::JoinHandle<Option<(u16, std::time::Instant)>> {
    let started = orca_relay::clock::instant();
    orca_relay::threads::spawn("test-desktop-leg", move || {
        for message in messages {
            // A relay that closes the pair while this is sent shows in the close read below.
            if leg.send(message).is_err() {
                break;
            }
        }
        set_read_timeout(&leg, Some(Duration::from_millis(100)));
        while !stop.load(Ordering::Acquire) && started.elapsed() < within {
            match leg.read() {
                Ok(Message::Close(frame)) => {
                    return frame.map(|f| (u16::from(f.code), orca_relay::clock::instant()))
                }
                Ok(_) => {}
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return None,
            }
        }
        None
    })
    .unwrap()
}

/// With `ORCA_RELAY_SPLICE_IDLE_MS=4000`, a desktop sends a phone one 1 MiB binary frame and the
/// phone reads it at 100 KB/s (about 10 s). The phone sends nothing of its own and answers pings,
/// but the relay's ping cannot reach it before the frame ends. What the relay writes to the
/// phone makes progress all along (the phone acknowledges it): it is not silent, and it gets the
/// whole frame and the message after it. (It was closed 4408 at 4 s, in the middle of the frame.
/// Counting the writes the socket took was not enough: with the kernel's send buffer grown to
/// hold 4 s of this reading, a run was closed at 8 s.)
#[test]
fn a_phone_receiving_a_large_frame_slowly_is_not_closed_as_silent() {
    let idle = Duration::from_millis(4_000);
    let relay = Relay::combined(&[("ORCA_RELAY_SPLICE_IDLE_MS", "4000")]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, leg) = slow_splice(&relay, &mut desktop);
    let payload: Vec<u8> = (0..1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let stop = Arc::new(AtomicBool::new(false));
    phone.get_mut().pace();
    let started = orca_relay::clock::instant();
    let sender = desktop_sending(
        leg,
        vec![Message::binary(payload.clone()), Message::text("after")],
        stop.clone(),
        Duration::from_secs(60),
    );
    let mut frame_at = None;
    let outcome = loop {
        match phone.read() {
            Ok(Message::Binary(bytes)) => {
                frame_at = Some(started.elapsed());
                assert!(bytes[..] == payload[..], "the frame is not byte-exact");
            }
            Ok(Message::Text(text)) => break Ok(text.to_string()),
            Ok(Message::Close(frame)) => break Err(format!("closed {frame:?}")),
            Ok(_) => {}
            Err(e) => break Err(format!("read failed: {e}")),
        }
    };
    let ended = started.elapsed();
    stop.store(true, Ordering::Release);
    let desktop_closed = sender.join().unwrap();
    let idle_log = relay.wait_for_log("orca_relay_splice_idle", Duration::ZERO);
    assert!(
        outcome.is_ok() && idle_log.is_none() && desktop_closed.is_none(),
        "the slow phone was judged silent: after {ended:?} (frame whole at {frame_at:?}) it got \
         {outcome:?}; the desktop got {:?}; log: {idle_log:?}",
        desktop_closed.map(|(code, at)| (code, at.duration_since(started)))
    );
    assert_eq!(outcome.unwrap(), "after");
    let frame_at = frame_at.expect("the frame arrived");
    assert!(
        frame_at >= idle * 2,
        "the frame took {frame_at:?}: not slow enough to span the idle window twice"
    );
    eprintln!("1 MiB at 100 KB/s: whole after {frame_at:?}, the next message after {ended:?}");
}

/// The other side of the rule: a phone that stops reading in the middle of a large frame (and so
/// answers nothing) is closed 4408 once it has acknowledged nothing more of what the relay wrote
/// for the idle window: not sooner, and at most a quarter window later (the relay looks at the
/// acknowledgements every quarter window while bytes are in flight), plus the moment the phone's
/// small receive buffer takes to fill. The wedge window is a minute here: only the idle judgement
/// can close it in time.
#[test]
fn a_phone_that_stops_reading_in_a_large_frame_is_closed_at_the_idle_timeout() {
    let idle = Duration::from_millis(4_000);
    let relay = Relay::combined(&[
        ("ORCA_RELAY_SPLICE_IDLE_MS", "4000"),
        ("ORCA_RELAY_WEDGE_MS", "60000"),
    ]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, leg) = slow_splice(&relay, &mut desktop);
    let stop = Arc::new(AtomicBool::new(false));
    phone.get_mut().pace();
    // Long enough for the phone's 3 s and twice the window after them.
    let sender = desktop_sending(
        leg,
        vec![Message::binary(vec![5u8; 1024 * 1024])],
        stop,
        Duration::from_secs(3) + idle * 2,
    );
    // Reads for 3 s (past half the window: the relay's ping waits behind the frame), then stops.
    let started = orca_relay::clock::instant();
    let mut buf = [0u8; SLOW_PHONE_READ];
    let mut got = 0;
    while started.elapsed() < Duration::from_secs(3) {
        got += phone.get_mut().read(&mut buf).expect("phone read");
    }
    let stopped = orca_relay::clock::instant();
    // The desktop is told its phone left (4408).
    let closed = sender.join().unwrap();
    let (code, at) = closed.expect("the desktop's leg was closed");
    let after = at.duration_since(stopped);
    eprintln!("read {got} bytes in 3 s, stopped: closed {code} after {after:?}");
    assert_eq!(code, 4408);
    assert!(
        after >= idle - Duration::from_millis(1_000),
        "closed {after:?} after the phone stopped reading: its reading was not counted"
    );
    assert!(
        after <= idle + idle / 4 + Duration::from_millis(1_000),
        "closed only {after:?} after the phone stopped reading (idle window {idle:?})"
    );
    let line = relay
        .wait_for_log("orca_relay_splice_idle", Duration::from_secs(1))
        .expect("logged as idle");
    assert!(line.contains("kind=phone"), "{line}");
    drop(phone);
}

// ---------------------------------------------------------------------------------------------
// TCP liveness on the worker's own sockets.

/// The relay's own descriptor of the TCP connection whose far end is `peer`, duplicated into
/// this process with `pidfd_getfd` (which needs the right to ptrace the relay: root, as the
/// suite runs, or the same user with `kernel.yama.ptrace_scope` 0). Closing the duplicate
/// leaves the relay's connection alone.
fn relay_socket_to(relay: &Relay, peer: std::net::SocketAddr) -> TcpStream {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let pid = relay.pid() as libc::pid_t;
    // SAFETY: pidfd_open takes a pid and flags; the descriptor it returns is owned below.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    assert!(
        pidfd >= 0,
        "pidfd_open: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh descriptor nobody else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let Ok(entry) = entry else { continue };
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|link| link.to_string_lossy().starts_with("socket:"));
        let Some(target) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if !is_socket {
            continue;
        }
        // SAFETY: pidfd_getfd duplicates the relay's descriptor `target` into this process;
        // the new descriptor is owned below.
        let fd =
            unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) } as i32;
        if fd < 0 {
            let error = std::io::Error::last_os_error();
            // Closed since the directory was read: the next.
            assert_eq!(
                error.raw_os_error(),
                Some(libc::EBADF),
                "pidfd_getfd: {error}"
            );
            continue;
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let stream = TcpStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
        if stream.peer_addr().is_ok_and(|addr| addr == peer) {
            return stream;
        }
    }
    panic!("the relay holds no connection to {peer}");
}

fn int_option(stream: &TcpStream, level: libc::c_int, name: libc::c_int) -> i32 {
    use std::os::fd::AsRawFd;
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into a local int.
    let result = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    assert_eq!(result, 0, "{}", std::io::Error::last_os_error());
    value
}

/// Both legs of a spliced pair, as the splice worker holds them, have TCP keepalive (probes
/// after 30 s idle, 3 every 10 s) and a 30 s `TCP_USER_TIMEOUT` (docs/PROTOCOL.md): read on
/// the relay's own sockets, not on what the setup function does to a socket of the test's.
#[test]
fn the_workers_own_sockets_have_tcp_keepalive_and_a_user_timeout() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, mut leg) = splice(&relay, &mut desktop);
    // A frame each way: the pair is on its worker.
    phone.send(Message::binary(vec![1u8; 16])).unwrap();
    assert_eq!(leg.read().unwrap(), Message::binary(vec![1u8; 16]));
    leg.send(Message::binary(vec![2u8; 16])).unwrap();
    assert_eq!(phone.read().unwrap(), Message::binary(vec![2u8; 16]));
    for (name, ws) in [("phone", &phone), ("data leg", &leg)] {
        let ours = relay_socket_to(&relay, ws.get_ref().local_addr().unwrap());
        let option = |level, option| int_option(&ours, level, option);
        assert_eq!(option(libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1, "{name}");
        assert_eq!(option(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 30, "{name}");
        assert_eq!(option(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 10, "{name}");
        assert_eq!(option(libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3, "{name}");
        assert_eq!(
            option(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
            30_000,
            "{name}"
        );
    }
    // The duplicates are gone; the relay's connections are not.
    phone.send(Message::binary(vec![3u8; 16])).unwrap();
    assert_eq!(leg.read().unwrap(), Message::binary(vec![3u8; 16]));
}

// ---------------------------------------------------------------------------------------------
// Cell-wide threads never wait on one socket.

/// A desktop that stopped reading its control socket: a tiny receive buffer, so the relay's
/// pings fill it within seconds.
fn wedged_desktop(relay: &Relay) -> TcpStream {
    wedged_desktop_placed(relay).0
}

/// [`wedged_desktop`], with its user, relay host id and placement epoch.
fn wedged_desktop_placed(relay: &Relay) -> (TcpStream, String, String, i64) {
    let relay_host_id = host_id();
    let user = format!("user-{relay_host_id}");
    let token = token(&user, &relay_host_id);
    let epoch = assign(relay, &token, &relay_host_id);
    // SAFETY: a plain socket(2); the descriptor is owned by the TcpStream made from it below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    assert!(fd >= 0);
    // A tiny receive buffer and small segments (so the relay's send buffer is sized for them,
    // not for loopback's 64 KiB segments): a few KiB of pings fill both.
    for (level, option, value) in [
        (libc::SOL_SOCKET, libc::SO_RCVBUF, 1),
        (libc::IPPROTO_TCP, libc::TCP_MAXSEG, 536),
    ] {
        let value: libc::c_int = value;
        // SAFETY: setsockopt reads one int from a local.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                option,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    let addr: std::net::SocketAddrV4 = relay.ws.parse().unwrap();
    let sockaddr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: connect reads a sockaddr_in we own.
    let connected = unsafe {
        libc::connect(
            fd,
            (&sockaddr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    assert_eq!(connected, 0);
    // SAFETY: fd is a connected socket nobody else owns.
    let mut stream = unsafe { <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    write!(
        stream,
        "GET /v1/host/control HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        stream.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 101"));
    let hello = serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch});
    stream
        .write_all(&client_frame(0x81, hello.to_string().as_bytes()))
        .unwrap();
    // The ack, then never read again.
    let mut frames = ServerFrames::default();
    let mut buf = [0u8; 256];
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    loop {
        if let Some((_, payload)) = frames.next() {
            assert!(String::from_utf8_lossy(&payload).contains("host-hello-ack"));
            break;
        }
        let n = stream.read(&mut buf).unwrap();
        frames.push(&buf[..n]);
    }
    (stream, user, relay_host_id, epoch)
}

/// `invite-create`s whose answers a wedged desktop never reads, until the relay stops reading
/// them: its control thread then waits (the wedge window) in the write of an answer, holding
/// the socket's writer.
fn hold_the_writer(desktop: &mut TcpStream) {
    let request = client_frame(0x81, br#"{"type":"invite-create","reqId":1}"#);
    let burst: Vec<u8> = request
        .iter()
        .copied()
        .cycle()
        .take(request.len() * 1_000)
        .collect();
    desktop
        .set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let deadline = orca_relay::clock::instant() + Duration::from_secs(30);
    loop {
        match desktop.write_all(&burst) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => panic!("the relay ended the wedged desktop: {e}"),
        }
        assert!(
            orca_relay::clock::instant() < deadline,
            "the relay kept reading the wedged desktop"
        );
    }
}

/// Watches a healthy desktop's pings: the longest gap between two of them.
fn longest_ping_gap(control: &mut Ws, over: Duration) -> Duration {
    let until = orca_relay::clock::instant() + over;
    let mut last = orca_relay::clock::instant();
    let mut worst = Duration::ZERO;
    while orca_relay::clock::instant() < until {
        expect_ping(control);
        worst = worst.max(last.elapsed());
        last = orca_relay::clock::instant();
    }
    worst
}

/// Three desktops that never read their control sockets (their buffers full of pings): the
/// other desktops' pings are not delayed by more than 1 s (before: each wedged socket held the
/// pinger for the 10 s send timeout), and a drain with them completes within its grace + 5 s.
#[test]
fn desktops_that_never_read_delay_neither_the_pinger_nor_the_drain() {
    let mut relay = Relay::combined(&[
        ("ORCA_RELAY_PING_MS", "5"),
        ("ORCA_RELAY_SILENCE_MS", "600000"),
        ("ORCA_RELAY_DRAIN_GRACE_MS", "2000"),
    ]);
    let mut healthy = Desktop::connect(&relay);
    let wedged: Vec<TcpStream> = (0..3).map(|_| wedged_desktop(&relay)).collect();
    // Their buffers fill with pings (about 40 bytes every 5 ms each).
    let gap = longest_ping_gap(&mut healthy.control, Duration::from_secs(10));
    assert!(
        gap <= Duration::from_millis(1_005),
        "a healthy desktop's pings stopped for {gap:?}"
    );
    // The drain: SIGTERM with the wedged desktops still connected.
    let started = orca_relay::clock::instant();
    relay.signal("TERM");
    let code = relay.wait_exit(Duration::from_secs(30));
    let took = started.elapsed();
    assert_eq!(code, Some(0), "{}", relay.log_text());
    assert!(
        took <= Duration::from_millis(2_000 + 5_000),
        "the drain took {took:?}"
    );
    drop(wedged);
}

/// Issue 30: a control whose write timed out (its desktop stopped reading) is shut down and
/// released at once: its unit goes back and its desktop reads the end of the connection.
/// Before, the writer was only marked broken and the control stayed seated, holding its seat
/// and its unit while nothing reached the desktop, until its silence ended it (75 s).
#[test]
fn a_control_whose_write_timed_out_is_shut_down_and_released() {
    const WEDGE_MS: u64 = 1_000;
    let relay = Relay::combined(&[
        ("ORCA_RELAY_WEDGE_MS", &WEDGE_MS.to_string()),
        // Only the control's own answers write to it: no ping finds the buffer full first.
        ("ORCA_RELAY_PING_MS", "600000"),
        ("ORCA_RELAY_SILENCE_MS", "600000"),
    ]);
    let mut desktop = wedged_desktop(&relay);
    assert_eq!(relay.metric("orca_relay_connection_units"), Some(1.0));
    // `invite-create`s whose answers are never read: the control's thread writes them until
    // the desktop's buffers are full, then waits the wedge window on one.
    let request = client_frame(0x81, br#"{"type":"invite-create","reqId":1}"#);
    let burst: Vec<u8> = request
        .iter()
        .copied()
        .cycle()
        .take(request.len() * 2_000)
        .collect();
    desktop
        .set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let sent = orca_relay::clock::instant();
    // The relay stops reading once its answer waits: a write that times out is that.
    let _ = desktop.write_all(&burst);
    assert!(
        wait_until(Duration::from_millis(WEDGE_MS + 10_000), || relay
            .metric("orca_relay_connection_units")
            == Some(0.0)),
        "the wedged control still holds its unit {:?} after its burst:\n{}",
        sent.elapsed(),
        relay.log_text()
    );
    // Its desktop reads what was written before, then the end of the connection.
    desktop
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 64 * 1024];
    loop {
        match desktop.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
                break;
            }
        }
    }
    // The cell goes on serving desktops.
    let mut other = Desktop::connect(&relay);
    assert!(!other.invite().is_empty());
    assert_eq!(relay.metric("orca_relay_connection_units"), Some(1.0));
}

/// SPEC §12, issue 30: the lease renewer never waits on one socket. Two database-admitted
/// desktops whose placements move: one stopped reading and its writer is held (its control
/// thread waits 30 s in a write), the other is healthy. Within 5 s the healthy one gets its
/// `drain` and 4503 and both give their units back: the renewer skipped the busy writer (its
/// `drain` without waiting, its close through the reaper) rather than waiting 30 s on it.
#[test]
fn the_lease_renewer_never_waits_on_a_desktop_that_stopped_reading() {
    let relay = Relay::combined(&[
        ("ORCA_RELAY_LEASE_RENEW_MS", "200"),
        ("ORCA_RELAY_WEDGE_MS", "30000"),
        ("ORCA_RELAY_PING_MS", "600000"),
        ("ORCA_RELAY_SILENCE_MS", "600000"),
    ]);
    let (mut wedged, wedged_user, wedged_host, wedged_epoch) = wedged_desktop_placed(&relay);
    let mut healthy = Desktop::connect(&relay);
    assert_eq!(relay.metric("orca_relay_connection_units"), Some(2.0));
    hold_the_writer(&mut wedged);

    // Another director places both elsewhere.
    let store = orca_relay::store::Store::open(&orca_relay::store::StoreConfig::new(
        None,
        relay.data_dir.0.join("relay.db"),
    ))
    .unwrap();
    let moved = orca_relay::clock::instant();
    for (user, host, epoch) in [
        (wedged_user.as_str(), wedged_host.as_str(), wedged_epoch),
        (
            healthy.user_id.as_str(),
            healthy.relay_host_id.as_str(),
            healthy.epoch,
        ),
    ] {
        assert!(store
            .place_assignment_if_newer(user, host, "elsewhere", epoch + 1, 0)
            .unwrap());
    }
    set_read_timeout(&healthy.control, Some(Duration::from_secs(5)));
    let drain = loop {
        match healthy.control.read() {
            Ok(Message::Text(text)) if !text.contains(r#""type":"ping""#) => break text,
            Ok(_) => {}
            Err(e) => panic!(
                "no drain for the healthy desktop {:?} after the moves: {e}",
                moved.elapsed()
            ),
        }
    };
    assert!(drain.contains(r#""type":"drain""#), "{drain}");
    assert_eq!(read_close(&mut healthy.control), Some(4503));
    assert!(
        wait_until(Duration::from_secs(5), || relay
            .metric("orca_relay_connection_units")
            == Some(0.0)),
        "a control still holds its unit {:?} after the moves:\n{}",
        moved.elapsed(),
        relay.log_text()
    );
    assert!(
        moved.elapsed() < Duration::from_secs(5),
        "{:?}",
        moved.elapsed()
    );
    assert!(relay.count_log("orca_relay_control_lease_moved") >= 2);
}

// ---------------------------------------------------------------------------------------------
// The memory the process can reach at its cap.

/// The process states the RSS it can reach at its cap (start-up line, `/metrics`) and keeps it
/// within the memory it has: a configured cap of 100,000 is lowered, with one WARN, to what
/// the descriptors or (when it binds first) the memory hold; the RSS at the cap in force never
/// exceeds that memory.
#[test]
fn the_cap_in_force_keeps_the_rss_at_the_cap_within_memory() {
    let relay = Relay::combined(&[("ORCA_RELAY_CONNECTION_CAP", "100000")]);
    let line = relay
        .wait_for_log("orca_relay_capacity ", Duration::from_secs(5))
        .expect("the capacity line");
    let number = |key: &str| -> u64 {
        field(&line, key)
            .unwrap_or_else(|| panic!("{key} in {line}"))
            .parse()
            .unwrap()
    };
    let (ceiling, cap, rss_at_cap, memory, per_connection) = (
        number("connections"),
        number("cap"),
        number("rss_at_cap"),
        number("memory"),
        number("per_connection_bytes"),
    );
    assert!(rss_at_cap <= memory, "{line}");
    assert!(cap <= ceiling, "{line}");
    // Stated in /metrics too.
    assert_eq!(
        relay.metric("orca_relay_capacity_rss_at_cap_bytes"),
        Some(rss_at_cap as f64)
    );
    assert_eq!(
        relay.metric("orca_relay_capacity_memory_bytes"),
        Some(memory as f64)
    );
    assert_eq!(relay.metric("orca_relay_connection_cap"), Some(cap as f64));
    // One WARN naming what bound it: memory when one more connection would not fit.
    let warn = relay
        .wait_for_log("orca_relay_connection_cap_lowered", Duration::from_secs(5))
        .expect("the WARN");
    assert_eq!(relay.count_log("orca_relay_connection_cap_lowered"), 1);
    if cap < ceiling {
        assert!(warn.contains("limited_by=memory"), "{warn}");
        assert!(rss_at_cap + per_connection > memory, "{line}");
    } else {
        assert!(warn.contains("limited_by=RLIMIT_NOFILE"), "{warn}");
    }
}
