//! Black-box tests of the splice data plane (issue 12) on the combined role: the real binary,
//! real sockets, real tungstenite clients. Backpressure per direction, the wedge timer, one
//! worker holding thousands of legs, a close behind pending output, bytes sent before the
//! attach, and a process filled to its computed capacity.

mod harness;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::*;
use tungstenite::Message;

/// A binary payload of `len` bytes whose content says where it sits in the stream.
fn numbered(seq: u64, len: usize) -> Vec<u8> {
    let mut payload = vec![(seq % 251) as u8; len];
    payload[..8].copy_from_slice(&seq.to_be_bytes());
    payload
}

fn seq_of(message: &Message) -> u64 {
    match message {
        Message::Binary(payload) => u64::from_be_bytes(payload[..8].try_into().unwrap()),
        other => panic!("expected a binary frame, got {other:?}"),
    }
}

/// Waits until `counter` has not moved for `quiet` (the writer is blocked), within `timeout`.
fn wait_for_stall(counter: &AtomicU64, quiet: Duration, timeout: Duration) -> bool {
    let mut last = counter.load(Ordering::Acquire);
    let mut since = orca_relay::clock::instant();
    wait_until(timeout, || {
        let now = counter.load(Ordering::Acquire);
        if now != last {
            last = now;
            since = orca_relay::clock::instant();
        }
        now > 0 && since.elapsed() >= quiet
    })
}

/// A desktop that stops reading its data leg stops the relay from reading that phone (the
/// phone's writes block once the kernel buffers and the relay's bounded pending output are
/// full) while another pair keeps its round trips fast; when the desktop reads again, every
/// frame arrives in order.
#[test]
fn a_desktop_that_stops_reading_slows_only_its_own_phone() {
    const FRAME: usize = 64 * 1024;
    const FRAMES: u64 = 1024; // 64 MiB offered: far more than buffers and the bound hold
    let relay = Relay::combined(&[("ORCA_RELAY_WEDGE_MS", "20000")]);
    let mut slow_desktop = Desktop::connect(&relay);
    let (mut slow_phone, mut slow_leg) = splice(&relay, &mut slow_desktop);
    let mut busy_desktop = Desktop::connect(&relay);
    let (mut busy_phone, mut busy_leg) = splice(&relay, &mut busy_desktop);

    let sent = Arc::new(AtomicU64::new(0));
    let writer_sent = sent.clone();
    let writer = orca_relay::threads::spawn("test-phone-writer", move || {
        for seq in 0..FRAMES {
            slow_phone
                .send(Message::binary(numbered(seq, FRAME)))
                .expect("phone send");
            writer_sent.fetch_add(FRAME as u64, Ordering::Release);
        }
        slow_phone
    })
    .unwrap();
    assert!(
        wait_for_stall(&sent, Duration::from_millis(700), Duration::from_secs(20)),
        "the phone's writes never stalled"
    );
    let stalled_at = sent.load(Ordering::Acquire);
    // Kernel buffers on both sockets (a few MiB each at most on loopback) plus the relay's
    // 1 MiB bound and one frame: far from the 64 MiB an unbounded relay would have taken.
    assert!(
        stalled_at < 24 * 1024 * 1024,
        "the relay kept reading a phone whose desktop does not read: {stalled_at} bytes"
    );

    // Meanwhile another pair is not slowed.
    let started = orca_relay::clock::instant();
    let mut worst = Duration::ZERO;
    for i in 0..50u64 {
        let sent_at = orca_relay::clock::instant();
        busy_phone.send(Message::binary(numbered(i, 64))).unwrap();
        let got = busy_leg.read().unwrap();
        assert_eq!(seq_of(&got), i);
        busy_leg.send(got).unwrap();
        assert_eq!(seq_of(&busy_phone.read().unwrap()), i);
        worst = worst.max(sent_at.elapsed());
    }
    assert!(
        worst < Duration::from_millis(500),
        "worst round trip of the other pair {worst:?} (50 in {:?})",
        started.elapsed()
    );

    // The desktop reads again: everything arrives, in order, and the phone finishes.
    for seq in 0..FRAMES {
        let message = slow_leg.read().expect("data leg read");
        assert_eq!(seq_of(&message), seq);
        assert_eq!(message.len(), FRAME);
    }
    let mut slow_phone = writer.join().unwrap();
    slow_phone.send(Message::binary(numbered(7, 16))).unwrap();
    assert_eq!(seq_of(&slow_leg.read().unwrap()), 7);
}

/// A desktop that never reads again: after the wedge window the phone sending to it is closed
/// 4429 and the desktop's leg dropped (SPEC §5.2), while the other pair keeps working.
#[test]
fn a_desktop_that_never_reads_is_dropped_and_its_phone_closed_4429_at_the_wedge_window() {
    let relay = Relay::combined(&[("ORCA_RELAY_WEDGE_MS", "1000")]);
    let mut desktop = Desktop::connect(&relay);
    let (phone, stalled_leg) = splice(&relay, &mut desktop);
    let (mut other_phone, mut other_leg) = splice(&relay, &mut desktop);
    let started = orca_relay::clock::instant();
    let writer = orca_relay::threads::spawn("test-phone-writer", move || {
        let mut phone = phone;
        let chunk = vec![3u8; 256 * 1024];
        for _ in 0..400 {
            if phone.send(Message::binary(chunk.clone())).is_err() {
                break;
            }
        }
        read_close(&mut phone)
    })
    .unwrap();
    assert_eq!(writer.join().unwrap(), Some(4429));
    assert!(
        started.elapsed() >= Duration::from_millis(1000),
        "closed before the wedge window: {:?}",
        started.elapsed()
    );
    other_phone.send(Message::text("still here")).unwrap();
    assert_eq!(other_leg.read().unwrap(), Message::text("still here"));
    drop(stalled_leg);
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_closes_total{code=\"4429\"}")
        == Some(1.0)));
}

/// A phone that sends a burst and then closes while its desktop is not reading: the relay
/// holds part of the burst as the desktop's pending output when it reads the close; the desktop
/// still gets every frame, in order, and only then the 4408.
#[test]
fn a_leg_closing_while_its_peer_has_pending_output_delivers_it_then_the_close() {
    const FRAME: usize = 64 * 1024;
    const FRAMES: u64 = 96; // 6 MiB: more than the loopback buffers and the bound take at once
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let (phone, mut leg) = splice(&relay, &mut desktop);
    let sent = Arc::new(AtomicU64::new(0));
    let writer_sent = sent.clone();
    let writer = orca_relay::threads::spawn("test-phone-writer", move || {
        let mut phone = phone;
        for seq in 0..FRAMES {
            phone.send(Message::binary(numbered(seq, FRAME))).unwrap();
            writer_sent.fetch_add(1, Ordering::Release);
        }
        phone.close(None).unwrap();
        let _ = phone.flush();
        phone
    })
    .unwrap();
    assert!(wait_for_stall(
        &sent,
        Duration::from_millis(500),
        Duration::from_secs(20)
    ));
    for seq in 0..FRAMES {
        let message = leg.read().expect("data leg read");
        assert_eq!(seq_of(&message), seq, "frame {seq}");
    }
    assert_eq!(read_close(&mut leg), Some(4408));
    drop(writer.join().unwrap());
}

/// Frames a phone sends right behind its `relay-auth`, before its host has attached, are read
/// by the relay thread along with the first frame; the hand-off carries them to the worker.
#[test]
fn frames_sent_before_the_attach_are_carried_into_the_splice() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let invite = desktop.invite();
    let mut phone = ws_connect(
        &relay.ws_url(&format!("/v1/connect/{}", desktop.relay_host_id)),
        None,
    )
    .unwrap();
    // relay-auth and three data frames in one write: one read takes them all.
    phone
        .write(Message::text(
            serde_json::json!({"type":"relay-auth","v":1,"credential":invite}).to_string(),
        ))
        .unwrap();
    for i in 0..3u64 {
        phone.write(Message::binary(numbered(i, 32))).unwrap();
    }
    phone.flush().unwrap();
    let (conn_id, ticket) = desktop.conn_open();
    let mut leg = ws_connect(&relay.ws_url(&format!("/v1/host/data/{conn_id}")), None).unwrap();
    leg.write(Message::text(
        serde_json::json!({"type":"host-data-auth","v":1,"connTicket":ticket,"generation":desktop.generation})
            .to_string(),
    ))
    .unwrap();
    leg.write(Message::text("from the desktop, early")).unwrap();
    leg.flush().unwrap();
    assert_eq!(
        read_json(&mut phone),
        serde_json::json!({"type":"relay-hello","ok":true})
    );
    for i in 0..3u64 {
        assert_eq!(seq_of(&leg.read().unwrap()), i);
    }
    assert_eq!(
        phone.read().unwrap(),
        Message::text("from the desktop, early")
    );
}

/// One worker (ORCA_RELAY_SPLICE_WORKERS=1) holds 2,000 legs: every pair forwards, the relay
/// threads are only the controls', and the legs are released when the clients leave.
#[test]
fn one_worker_handles_thousands_of_legs() {
    const DESKTOPS: usize = 125;
    const PHONES: usize = 8;
    // This process holds the 2,125 client sockets.
    let _ = orca_relay::lifecycle::raise_fd_limit();
    let relay = Relay::combined(&[
        ("ORCA_RELAY_SPLICE_WORKERS", "1"),
        ("ORCA_RELAY_CONNECTION_CAP", "5000"),
    ]);
    let mut desktops = Vec::new();
    let mut pairs = Vec::new();
    for _ in 0..DESKTOPS {
        let mut desktop = Desktop::connect(&relay);
        for _ in 0..PHONES {
            pairs.push(splice(&relay, &mut desktop));
        }
        desktops.push(desktop);
    }
    let legs = (DESKTOPS * PHONES * 2) as f64;
    assert!(
        wait_until(Duration::from_secs(10), || relay
            .metric("orca_relay_splice_legs{worker=\"0\"}")
            == Some(legs)),
        "legs on worker 0: {:?}",
        relay.metric("orca_relay_splice_legs{worker=\"0\"}")
    );
    // Every pair forwards both ways: all phones write first, then every leg is read.
    for (i, (phone, _)) in pairs.iter_mut().enumerate() {
        phone
            .send(Message::binary(numbered(i as u64, 100)))
            .unwrap();
    }
    for (i, (phone, leg)) in pairs.iter_mut().enumerate() {
        assert_eq!(seq_of(&leg.read().unwrap()), i as u64);
        leg.send(Message::binary(numbered(i as u64 + 1_000_000, 100)))
            .unwrap();
        assert_eq!(seq_of(&phone.read().unwrap()), i as u64 + 1_000_000);
    }
    // Relay threads: the controls' (the spliced legs have none).
    let running = relay
        .metric("orca_relay_relay_threads{state=\"running\"}")
        .unwrap();
    assert!(
        running <= DESKTOPS as f64 + 8.0,
        "{running} relay threads for {DESKTOPS} controls"
    );
    drop(pairs);
    assert!(
        wait_until(Duration::from_secs(10), || relay
            .metric("orca_relay_splice_legs{worker=\"0\"}")
            == Some(0.0)),
        "legs left: {:?}",
        relay.metric("orca_relay_splice_legs{worker=\"0\"}")
    );
    assert!(wait_until(Duration::from_secs(10), || relay
        .metric("orca_relay_connection_units")
        == Some(DESKTOPS as f64)));
    drop(desktops);
}

/// The combined role, its descriptor limit lowered to 1,024, filled to the capacity it
/// computed: the configured cap is lowered to it with one WARN, the process stays up, `/health`
/// answers throughout, connections past it are refused 503 and counted, and once the sockets
/// close new desktops are admitted again.
#[test]
fn a_process_filled_to_its_computed_capacity_refuses_and_recovers() {
    let _ = orca_relay::lifecycle::raise_fd_limit();
    let mut relay = Relay::combined_with_nofile(
        &[
            ("ORCA_RELAY_CONNECTION_CAP", "100000"),
            ("ORCA_RELAY_HTTP_CONNECTIONS_MAX", "16"),
            ("ORCA_RELAY_PENDING_UPGRADES_MAX", "16"),
        ],
        1024,
    );
    let line = relay
        .wait_for_log("orca_relay_capacity ", Duration::from_secs(5))
        .expect("the capacity line");
    let ceiling: u64 = field(&line, "connections").unwrap().parse().unwrap();
    assert_eq!(field(&line, "limited_by").as_deref(), Some("RLIMIT_NOFILE"));
    assert_eq!(field(&line, "cap"), Some(ceiling.to_string()));
    assert!((100..1024).contains(&ceiling), "{line}");
    let warn = relay
        .wait_for_log("orca_relay_connection_cap_lowered", Duration::from_secs(5))
        .expect("the WARN");
    assert!(warn.contains("WARN"), "{warn}");
    assert!(warn.contains("limited_by=RLIMIT_NOFILE"), "{warn}");
    assert_eq!(relay.count_log("orca_relay_connection_cap_lowered"), 1);
    assert_eq!(
        relay.metric("orca_relay_capacity_connections"),
        Some(ceiling as f64)
    );

    // Fill: desktops with 8 spliced phones each (17 connections), then lone controls.
    let units = || relay.metric("orca_relay_connection_units").unwrap() as u64;
    let mut desktops = Vec::new();
    let mut pairs = Vec::new();
    while units() + 17 <= ceiling {
        let mut desktop = Desktop::connect(&relay);
        for _ in 0..8 {
            pairs.push(splice(&relay, &mut desktop));
        }
        desktops.push(desktop);
        assert_eq!(relay.get("/health").0, 200);
    }
    while units() < ceiling {
        desktops.push(Desktop::connect(&relay));
    }
    assert_eq!(units(), ceiling);
    assert_eq!(relay.get("/health").0, 200);

    // Past the ceiling: a desktop's control and a phone are refused 503 and counted.
    let refused_before = relay
        .metric("orca_relay_upgrades_refused_total{status=\"503\",reason=\"connection_cap\"}")
        .unwrap_or(0.0);
    for _ in 0..5 {
        let relay_host_id = host_id();
        let token = token(&format!("user-{relay_host_id}"), &relay_host_id);
        assert_eq!(
            ws_connect(&relay.ws_url("/v1/host/control"), Some(&token)).err(),
            Some(503)
        );
        let phone_url = relay.ws_url(&format!("/v1/connect/{}", desktops[0].relay_host_id));
        assert_eq!(ws_connect(&phone_url, None).err(), Some(503));
        assert_eq!(relay.get("/health").0, 200);
    }
    assert_eq!(
        relay.metric("orca_relay_upgrades_refused_total{status=\"503\",reason=\"connection_cap\"}"),
        Some(refused_before + 10.0)
    );
    // The spliced pairs still carry data at the ceiling.
    let (phone, leg) = &mut pairs[0];
    phone.send(Message::text("at the ceiling")).unwrap();
    assert_eq!(leg.read().unwrap(), Message::text("at the ceiling"));

    // Everything closes: the units come back and new desktops are admitted.
    drop(pairs);
    drop(desktops);
    assert!(
        wait_until(Duration::from_secs(15), || units() == 0),
        "units left: {}",
        units()
    );
    let mut again = Desktop::connect(&relay);
    let (mut phone, mut leg) = splice(&relay, &mut again);
    phone.send(Message::text("admitted again")).unwrap();
    assert_eq!(leg.read().unwrap(), Message::text("admitted again"));
    assert_eq!(relay.get("/health").0, 200);
    // The process never went down.
    assert_eq!(relay.wait_exit(Duration::from_millis(10)), None);
}

/// A phone that sends its last frames and hangs up at once (the data and the end of stream
/// arrive together, in one edge of the worker's epoll): the desktop gets the frames, then 4408.
#[test]
fn frames_followed_at_once_by_a_hang_up_arrive_before_the_4408() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    for round in 0..20u64 {
        let (mut phone, mut leg) = splice(&relay, &mut desktop);
        phone.write(Message::binary(numbered(round, 300))).unwrap();
        phone
            .write(Message::binary(numbered(round + 1, 300)))
            .unwrap();
        phone.flush().unwrap();
        drop(phone);
        assert_eq!(seq_of(&leg.read().unwrap()), round, "round {round}");
        assert_eq!(seq_of(&leg.read().unwrap()), round + 1, "round {round}");
        assert_eq!(read_close(&mut leg), Some(4408), "round {round}");
    }
}
