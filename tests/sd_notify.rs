//! The process-lifecycle helpers seen from outside the process: `sd_notify` datagrams arrive
//! on a real `NOTIFY_SOCKET` (a path and an abstract name), nothing happens without one, and
//! a second SIGTERM exits at once with status 0 after the first began the drain.
//!
//! Each case re-runs this test binary as a child with one `child_*` test selected and
//! `ORCA_RELAY_LIFECYCLE_PROBE` set, so the environment and the signals belong to the child,
//! never to this process (other tests run in parallel here). Run without that variable, the
//! `child_*` tests do nothing.

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use orca_relay::lifecycle::{self, Shutdown, ShutdownState};

const PROBE_VAR: &str = "ORCA_RELAY_LIFECYCLE_PROBE";

/// Runs `test_name` from this binary in a child process with `envs` set and the systemd
/// variables otherwise removed.
fn run_child(test_name: &str, envs: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("test binary path");
    let mut command = Command::new(exe);
    command
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(PROBE_VAR, "1")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .env_remove("WATCHDOG_PID");
    for (key, value) in envs {
        command.env(key, value);
    }
    command.output().expect("run child")
}

fn is_child() -> bool {
    std::env::var_os(PROBE_VAR).is_some()
}

/// A name no other test or process uses at the same time.
fn unique_name(label: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "orca-relay-{label}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

/// Reads datagrams until `count` arrived or none came for five seconds.
fn receive(socket: &UnixDatagram, count: usize) -> Vec<String> {
    socket
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("read timeout");
    let mut messages = Vec::new();
    let mut buffer = [0u8; 4096];
    while messages.len() < count {
        match socket.recv(&mut buffer) {
            Ok(n) => messages.push(String::from_utf8_lossy(&buffer[..n]).into_owned()),
            Err(_) => break,
        }
    }
    messages
}

fn assert_child_passed(output: &Output) {
    assert!(
        output.status.success(),
        "child failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // A filter that matched nothing would also exit 0.
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("test result: ok. 1 passed"), "{stdout}");
}

#[test]
fn child_sends_every_notification() {
    if !is_child() {
        return;
    }
    lifecycle::notify_ready();
    lifecycle::notify_status("registered\nwith 1 director");
    lifecycle::notify_watchdog();
    lifecycle::notify_stopping();
}

#[test]
fn notifications_arrive_on_a_path_socket() {
    let dir = std::env::temp_dir().join(unique_name("notify"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&path).expect("bind notify socket");

    let output = run_child(
        "child_sends_every_notification",
        &[("NOTIFY_SOCKET", path.to_str().expect("utf-8 temp path"))],
    );

    assert_child_passed(&output);
    assert_eq!(
        receive(&socket, 4),
        vec![
            "READY=1",
            "STATUS=registered with 1 director",
            "WATCHDOG=1",
            "STOPPING=1"
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn notifications_arrive_on_an_abstract_socket() {
    use std::os::linux::net::SocketAddrExt;
    let name = unique_name("notify-abstract");
    let address =
        std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("address");
    let socket = UnixDatagram::bind_addr(&address).expect("bind abstract socket");

    let output = run_child(
        "child_sends_every_notification",
        &[("NOTIFY_SOCKET", &format!("@{name}"))],
    );

    assert_child_passed(&output);
    assert_eq!(
        receive(&socket, 4)[..2],
        ["READY=1", "STATUS=registered with 1 director"]
    );
}

#[test]
fn without_notify_socket_notifications_are_silent_no_ops() {
    let output = run_child("child_sends_every_notification", &[]);
    assert_child_passed(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("sd_notify_failed"), "{stderr}");
}

#[test]
fn child_drains_on_first_sigterm_and_exits_on_second() {
    if !is_child() {
        return;
    }
    let shutdown = Shutdown::new();
    let (drained, drain_seen) = mpsc::channel::<()>();
    shutdown.on_drain(Box::new(move || {
        let _ = drained.send(());
    }));
    let _signals = lifecycle::install_signal_handlers(&shutdown).expect("install handlers");

    // SAFETY: kill(2) on our own pid with a signal we handle.
    unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    assert!(
        shutdown.wait_timeout(Duration::from_secs(5)),
        "first SIGTERM drains"
    );
    drain_seen
        .recv_timeout(Duration::from_secs(5))
        .expect("the drain callback ran");
    assert_eq!(shutdown.state(), ShutdownState::Draining);
    println!("probe: draining");

    // SAFETY: as above. The signals thread now exits the process with status 0.
    unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    let (_never, nothing) = mpsc::channel::<()>();
    let _ = nothing.recv_timeout(Duration::from_secs(10));
    println!("probe: still alive after the second SIGTERM");
    std::process::exit(3);
}

#[test]
fn a_second_sigterm_exits_at_once_after_the_first_began_the_drain() {
    let dir = std::env::temp_dir().join(unique_name("signals"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&path).expect("bind notify socket");

    let output = run_child(
        "child_drains_on_first_sigterm_and_exits_on_second",
        &[
            ("NOTIFY_SOCKET", path.to_str().expect("utf-8 temp path")),
            ("RUST_LOG", "info"),
        ],
    );

    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "stdout:\n{stdout}");
    assert!(stdout.contains("probe: draining"), "{stdout}");
    assert!(!stdout.contains("still alive"), "{stdout}");
    assert_eq!(
        receive(&socket, 1),
        vec!["STOPPING=1"],
        "the drain tells systemd"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
