//! Interrupted system calls (`EINTR`) in the relay's own socket code (SPEC §11): the HTTP
//! server's head reader and writer, the control socket's reader and the splice reader. A
//! blocking `recv` or `send` on a socket with a timeout fails with `EINTR` when
//! the process is stopped and continued, or when a signal whose handler lacks `SA_RESTART`
//! arrives. The second is what these tests use, because it can be aimed at one thread of the
//! test process: a no-op `SIGUSR2` handler without `SA_RESTART`, sent again and again with
//! `pthread_kill` to the thread blocked in the call. The call must still succeed.
//!
//! The black-box form of the same question (the whole relay stopped and continued) is
//! `tests/pause_blackbox.rs`.
//!
//! The suite's own WebSocket client (`tests/harness`) is held to the same rule: a test process
//! can be stopped and continued too.

mod harness;

use std::sync::mpsc;
use std::sync::Once;
use std::time::Duration;

extern "C" fn ignore(_: libc::c_int) {}

/// Installs the no-op `SIGUSR2` handler without `SA_RESTART`, once per test process.
fn install_interrupting_handler() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe (it does
        // nothing), and SIGUSR2 is used by nothing else in this test binary.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore as *const () as libc::sighandler_t;
            action.sa_flags = 0; // no SA_RESTART: blocking calls fail with EINTR
            libc::sigemptyset(&mut action.sa_mask);
            assert_eq!(
                libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()),
                0
            );
        }
    });
}

/// Runs `call` on its own thread and interrupts that thread every 20 ms until it returns.
fn interrupted<T: Send + 'static>(call: impl FnOnce() -> T + Send + 'static) -> (T, u32) {
    install_interrupting_handler();
    let (thread_tx, thread_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let worker = orca_relay::threads::spawn("test-interrupted", move || {
        // SAFETY: pthread_self has no preconditions.
        thread_tx.send(unsafe { libc::pthread_self() }).unwrap();
        let value = call();
        done_tx.send(()).unwrap();
        value
    })
    .unwrap();
    let thread = thread_rx.recv().unwrap();
    let mut signals = 0;
    // Until the call returns, or panics (its end of the channel drops: the join below fails).
    while let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(Duration::from_millis(20))
    {
        // SAFETY: the thread is not joined before the loop ends (below), so its pthread_t is
        // valid.
        unsafe { libc::pthread_kill(thread, libc::SIGUSR2) };
        signals += 1;
    }
    (worker.join().unwrap(), signals)
}

/// A connected loopback pair: (client, server side).
fn tcp_pair() -> (std::net::TcpStream, std::net::TcpStream) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    (client, server)
}

/// One masked client text frame (RFC 6455 §5.2), as a desktop sends it.
fn masked_text_frame(text: &str) -> Vec<u8> {
    let mask = [0x11, 0x22, 0x33, 0x44];
    assert!(text.len() < 126);
    let mut frame = vec![0x81, 0x80 | text.len() as u8];
    frame.extend_from_slice(&mask);
    frame.extend(text.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    frame
}

/// The HTTP server's own reader (`http::head`, the request head of every request on both
/// listeners): a head that arrives while the reading thread is being interrupted is read
/// whole, each `EINTR` retried (issue 20: these tests used to exercise only ureq and std).
#[test]
fn the_http_head_reader_retries_interrupted_reads_and_reads_the_head() {
    let (mut client, server) = tcp_pair();
    let writer = orca_relay::threads::spawn("test-late-writer", move || {
        orca_relay::clock::sleep(Duration::from_millis(500));
        std::io::Write::write_all(&mut client, b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")
            .unwrap();
        client
    })
    .unwrap();
    let (head, signals) = interrupted(move || {
        let mut reader = orca_relay::http::head::HeadReader::new();
        let deadline = orca_relay::clock::instant() + Duration::from_secs(5);
        reader
            .read_head(&server, deadline)
            .map(|head| (head.method, head.target))
            .map_err(|e| format!("{e:?}"))
    });
    let _client = writer.join().unwrap();
    assert!(signals >= 10, "the read was interrupted {signals} times");
    assert_eq!(head, Ok(("GET".to_string(), "/health".to_string())));
}

/// The HTTP server's own writer (`http::head::write_all_by`, every answer): a write that
/// blocks on a slow reader while its thread is being interrupted still writes every byte.
#[test]
fn the_http_writer_retries_interrupted_writes_and_writes_every_byte() {
    const BYTES: usize = 8 * 1024 * 1024;
    let (client, server) = tcp_pair();
    let reader = orca_relay::threads::spawn("test-slow-reader", move || {
        // Late, so the writer blocks on a full socket buffer and is interrupted there.
        orca_relay::clock::sleep(Duration::from_millis(500));
        let mut received = Vec::new();
        std::io::Read::read_to_end(&mut &client, &mut received).unwrap();
        received
    })
    .unwrap();
    let (written, signals) = interrupted(move || {
        let payload: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8).collect();
        let deadline = orca_relay::clock::instant() + Duration::from_secs(10);
        let result = orca_relay::http::head::write_all_by(&server, &payload, deadline);
        drop(server);
        result.map_err(|e| e.to_string())
    });
    let received = reader.join().unwrap();
    assert!(signals >= 10, "the write was interrupted {signals} times");
    assert_eq!(written, Ok(()));
    assert_eq!(received.len(), BYTES);
    assert!(received
        .iter()
        .enumerate()
        .all(|(i, b)| *b == (i % 251) as u8));
}

#[test]
fn the_harness_really_interrupts_a_bare_recv_with_a_timeout() {
    // Without this, the other tests here could pass by never seeing EINTR at all.
    let (_client, server) = tcp_pair();
    server
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let (kind, _) = interrupted(move || {
        let mut buf = [0u8; 16];
        std::io::Read::read(&mut &server, &mut buf)
            .map(|_| ())
            .unwrap_err()
            .kind()
    });
    assert_eq!(kind, std::io::ErrorKind::Interrupted);
}

#[test]
fn the_control_reader_retries_interrupted_reads_and_reads_the_frame() {
    let (mut client, server) = tcp_pair();
    server
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let socket = orca_relay::relay::socket::Socket::new_control(1, server);
    let mut reader = orca_relay::relay::control_reader::Reader::new(
        socket,
        orca_relay::relay::control_reader::ControlFrames::new(Vec::new()),
        orca_relay::relay::park::Quiesce::new().unwrap(),
        orca_relay::relay::control_reader::SilenceGuard {
            pauses: orca_relay::pause_clock::PauseClock::new(orca_relay::clock::system()),
            resume_grace: Duration::from_secs(1),
            buffers: orca_relay::relay::buffer_budget::BufferBudget::new(
                orca_relay::relay::buffer_budget::DEFAULT_BUDGET_BYTES,
            ),
        },
    );
    let writer = orca_relay::threads::spawn("test-late-writer", move || {
        orca_relay::clock::sleep(Duration::from_millis(500));
        std::io::Write::write_all(&mut client, &masked_text_frame("{\"type\":\"pong\"}")).unwrap();
        client
    })
    .unwrap();
    let deadline = orca_relay::relay::control_reader::Deadline::At(
        orca_relay::clock::instant() + Duration::from_secs(5),
    );
    let (event, signals) = interrupted(move || format!("{:?}", reader.read(deadline)));
    let _client = writer.join().unwrap();
    assert!(signals >= 10, "interrupted {signals} times");
    assert!(
        event.starts_with("Message(Text(") && event.contains("pong"),
        "an interrupted read is not the peer leaving: {event}"
    );
}

#[test]
fn the_first_frame_reader_retries_interrupted_reads_and_reads_the_frame() {
    let (mut client, server) = tcp_pair();
    server
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut reader = orca_relay::relay::splice_reader::FirstFrameReader::new(Vec::new(), 1 << 20);
    let writer = orca_relay::threads::spawn("test-late-writer", move || {
        orca_relay::clock::sleep(Duration::from_millis(500));
        std::io::Write::write_all(&mut client, &masked_text_frame("spliced")).unwrap();
        client
    })
    .unwrap();
    let (event, signals) = interrupted(move || {
        let filled = reader.fill(&server);
        format!("{filled:?} {:?}", reader.take_frame())
    });
    let _client = writer.join().unwrap();
    assert!(signals >= 10, "interrupted {signals} times");
    assert!(event.contains("Text(\"spliced\")"), "{event}");
}

/// The harness's WebSocket client reads through interrupted calls. A clean-clone CI run saw
/// `operations_blackbox::a_drain_with_a_desktop_still_connected_sleeps_instead_of_spinning`
/// read no close code: the relay drained and closed the desktop 4503 as it should, but the
/// test process had been stopped and continued while its client waited in a timed `recv`,
/// which failed with `EINTR`, and tungstenite passed that on as a failed read.
#[test]
fn the_harness_client_reads_through_interrupted_calls() {
    let relay = harness::Relay::combined(&[("ORCA_RELAY_PING_MS", "300")]);
    let desktop = harness::Desktop::connect(&relay);
    let mut control = desktop.control;
    // Each ping is waited for ~300 ms in one blocking read, interrupted every 20 ms.
    let ((), signals) = interrupted(move || {
        for _ in 0..3 {
            harness::expect_ping(&mut control);
        }
    });
    assert!(signals >= 10, "interrupted {signals} times");
}
