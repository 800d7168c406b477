//! The HTTP listener (SPEC §5.4): stalled clients do not delay other requests, a stalled request
//! head is answered 408 and closed at the head deadline, and the listener keeps serving after
//! idle periods. (`tests/network_edge.rs` holds the timing figures of the network edge.)

mod harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use harness::*;

#[test]
fn stalled_clients_do_not_delay_health_and_are_closed() {
    let relay = Relay::combined(&[]);
    // Clients that send half a request head and stall, arriving the way a slow-loris attack
    // does: one after another.
    let mut stalled = Vec::new();
    for _ in 0..20 {
        let mut stream = TcpStream::connect(&relay.http).unwrap();
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            .unwrap();
        stalled.push(stream);
        orca_relay::clock::sleep(Duration::from_millis(25));
    }
    for _ in 0..20 {
        let started = orca_relay::clock::instant();
        assert_eq!(relay.get("/health").0, 200);
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
    }
    // A stalled head is answered 408 and closed at the 10 s head deadline.
    let mut first = stalled.remove(0);
    first
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let started = orca_relay::clock::instant();
    let mut answer = String::new();
    let _ = first.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(answer.contains("Connection: close"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(12));
    // More than 10 idle seconds have passed: the listener still serves.
    assert_eq!(relay.get("/health").0, 200);
    assert_eq!(relay.get("/ready").0, 200);
}

/// A keep-alive connection that asks every second for 14 s is answered every time, past the
/// 10 s head deadline of its first request and without a new connection arriving meanwhile.
/// This is a director's feed poller, which reuses one connection per cell: one unanswered poll
/// is a 2 s timeout, enough to break the cell's contact bound (2 × FEED_POLL_MS).
#[test]
fn a_keep_alive_connection_asking_every_second_is_answered_every_time() {
    let relay = Relay::combined(&[]);
    let mut stream = TcpStream::connect(&relay.http).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut answers = 0;
    let started = orca_relay::clock::instant();
    while started.elapsed() < Duration::from_secs(14) {
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 512];
        while !String::from_utf8_lossy(&head).contains("{\"ok\":true}") {
            let n = stream.read(&mut buf).unwrap_or_else(|e| {
                panic!(
                    "request {} after {:?} went unanswered: {e}",
                    answers + 1,
                    started.elapsed()
                )
            });
            assert!(n > 0, "the connection closed after {answers} answers");
            head.extend_from_slice(&buf[..n]);
        }
        answers += 1;
        orca_relay::clock::sleep(Duration::from_secs(1));
    }
    assert!(answers >= 12, "{answers}");
}
