//! The live handover at its edges (issue 31, point 5), on the real binary: a stop requested
//! during a handover is honoured (it rolls back and the running relay drains); the token never
//! appears on a command line; the `handover` command and the next process talk only to a
//! handover socket of their own user; a control whose write broke half-way through a frame is
//! never resumed by the next process behind that half frame; the command's last line says what
//! really happened when the running relay dies during the handover.
//!
//! A handover is held at a chosen point by stopping the next process (`SIGSTOP`) as soon as it
//! exists: it cannot confirm, so nothing can commit until it is continued.

mod handover_kit;
mod harness;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use handover_kit::Serving;
use harness::*;
use orca_relay::handover::wire;
use serde_json::{json, Value};

const DEADLINE: Duration = Duration::from_secs(60);

fn ready(relay: &Relay) {
    assert!(
        wait_until(DEADLINE, || relay.get("/ready").0 == 200),
        "never ready: {}",
        relay.log_text()
    );
}

/// `orca-relay handover` for `relay`, started in the background.
fn start_handover(relay: &Relay) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_orca-relay"));
    command.arg("handover").env_clear();
    for (name, value) in &relay.env {
        command.env(name, value);
    }
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start orca-relay handover")
}

/// The command's exit code, standard output and standard error.
fn finish(child: Child) -> (i32, String, String) {
    let output = child.wait_with_output().expect("the handover command");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).to_string(),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

/// A process's command line, its arguments joined by spaces.
fn command_line(pid: u32) -> Option<String> {
    let bytes = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        bytes
            .split(|b| *b == 0)
            .map(|arg| String::from_utf8_lossy(arg).to_string())
            .collect::<Vec<_>>()
            .join(" "),
    )
}

/// A running next process of a handover on `socket`, if there is one.
fn running_next_process(socket: &Path) -> Option<u32> {
    let socket = socket.to_string_lossy().to_string();
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let line = command_line(pid)?;
            (line.contains("--take-over") && line.contains(&socket)).then_some(pid)
        })
}

/// The next process of a handover of the relay whose data directory is `data_dir`, stopped
/// (`SIGSTOP`) the moment it is found; its pid.
fn stop_next_process(data_dir: &Path) -> u32 {
    let socket = orca_relay::handover::socket_path(data_dir)
        .to_string_lossy()
        .to_string();
    let deadline = now_instant() + Duration::from_secs(30);
    loop {
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Some(line) = command_line(pid) else {
                continue;
            };
            if line.contains("--take-over") && line.contains(&socket) {
                // SAFETY: kill(2) on the test's own next process.
                unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
                return pid;
            }
        }
        assert!(now_instant() < deadline, "no next process appeared");
        std::thread::yield_now();
    }
}

fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) on a process this test started.
    unsafe { libc::kill(pid as i32, signal) };
}

/// A desktop with its control open (a harness WebSocket).
fn desktop(relay: &Relay) -> Desktop {
    let desktop = Desktop::connect(relay);
    set_read_timeout(&desktop.control, Some(Duration::from_secs(20)));
    desktop
}

/// Reads the control until a close; whether a `drain` came first, and the close code.
fn drained(desktop: &mut Desktop) -> (bool, Option<u16>) {
    let mut saw_drain = false;
    loop {
        match desktop.control.read() {
            Ok(tungstenite::Message::Text(text)) => {
                saw_drain |= text.contains("\"drain\"");
            }
            Ok(tungstenite::Message::Close(frame)) => {
                return (saw_drain, frame.map(|f| u16::from(f.code)));
            }
            Ok(_) => {}
            Err(tungstenite::Error::Io(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return (saw_drain, None),
        }
    }
}

/// Point 5: a SIGTERM to the running relay while a handover is in progress (its next process
/// not yet confirmed). Before: the handover committed anyway and the running relay exited 0
/// without a drain (the stop was lost: the desktops heard nothing). Now the handover rolls back
/// (the command says why), the running relay drains (`drain`, then 4503) and exits 0, and the
/// next process exits without touching anything. Its command line carries no token either
/// (before: `--token <token>`, readable by every user in `/proc`).
#[test]
fn a_stop_during_a_handover_rolls_it_back_and_the_running_relay_drains() {
    handover_kit::adopt_orphans();
    let mut relay = Relay::combined(&[("ORCA_RELAY_DRAIN_GRACE_MS", "2000")]);
    ready(&relay);
    let mut desktops: Vec<Desktop> = (0..3).map(|_| desktop(&relay)).collect();
    let command = start_handover(&relay);
    let next = stop_next_process(&relay.data_dir.0);
    let next_line = command_line(next).unwrap_or_default();
    relay.signal("TERM");
    // The stop has reached the running relay before the next process may go on.
    assert!(
        relay
            .wait_for_log("orca_relay_shutdown_draining", Duration::from_secs(20))
            .is_some(),
        "{}",
        relay.log_text()
    );
    signal(next, libc::SIGCONT);
    let (code, stdout, stderr) = finish(command);
    for (index, desktop) in desktops.iter_mut().enumerate() {
        let (saw_drain, close) = drained(desktop);
        assert!(
            saw_drain && close == Some(4503),
            "desktop {index}: drain {saw_drain}, close {close:?}\ncommand: {code} {stdout} {stderr}\n{}",
            relay.log_text()
        );
    }
    assert_eq!(relay.wait_exit(Duration::from_secs(30)), Some(0));
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(
        stderr.contains("keeps serving") && stderr.contains("stop (SIGTERM)"),
        "{stderr}"
    );
    assert_eq!(relay.count_log("orca_relay_handover_failed"), 1);
    assert_eq!(relay.count_log("orca_relay_handover_committed"), 0);
    let next = Serving { pid: next };
    assert_eq!(next.wait_exit(Duration::from_secs(30)), Some(1));
    assert!(
        next_line.contains("--take-over") && !next_line.contains("--token"),
        "the next process's command line: {next_line}"
    );
}

/// Point 5: the running relay dies (SIGKILL) in the middle of a handover. Before, the command
/// said "failed, the running relay keeps serving", which was false: nothing served. Now its
/// last line says that the running relay died and that the new process did not take over.
#[test]
fn the_command_says_so_when_the_running_relay_dies_during_the_handover() {
    handover_kit::adopt_orphans();
    let mut relay = Relay::combined(&[]);
    ready(&relay);
    let _desktop = desktop(&relay);
    let old_pid = relay.pid();
    let command = start_handover(&relay);
    let next = stop_next_process(&relay.data_dir.0);
    relay.signal("KILL");
    let _ = relay.wait_exit(Duration::from_secs(10));
    signal(next, libc::SIGCONT);
    let (code, stdout, stderr) = finish(command);
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(
        !stderr.contains("keeps serving")
            && stderr.contains(&format!("the running relay (pid {old_pid}) died"))
            && stderr.contains(&format!(
                "the new process (pid {next}) exited without taking over"
            )),
        "{stderr}"
    );
    let next = Serving { pid: next };
    assert_eq!(next.wait_exit(Duration::from_secs(30)), Some(1));
}

/// Point 5: the running relay commits, then goes away without telling the command (it exits
/// right after `committed`; here a stand-in plays it, with a kept state of an earlier build,
/// `tests/fixtures/handover`). Before, the command said "failed, the running relay keeps
/// serving … the outcome is unknown" while the new process served every connection. Now the
/// new process tells the command it was committed, and the command says so and exits 0.
#[test]
fn the_command_says_committed_when_the_running_relay_exits_before_reporting() {
    use handover_kit::fixture::{self, Captured, Giver};
    use orca_relay::handover::{self as protocol, receive, send, Accepted, Kind};
    handover_kit::adopt_orphans();
    let dir = fixture::dir(1);
    let read = |name: &str| std::fs::read(dir.join(name)).expect("the fixture");
    let captured = Captured {
        cell: read("cell.json"),
        pairs: read("pairs.json"),
        cell_raw: Vec::new(),
        pairs_raw: Vec::new(),
    };
    let notes: Value = serde_json::from_slice(&read("notes.json")).unwrap();
    let cell: Value = serde_json::from_slice(&captured.cell).unwrap();
    let data_dir = TempDir::new("edges");
    let log_path = data_dir.0.join("next.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let socket = protocol::socket_path(&data_dir.0);
    let mut giver = Giver::listen(&socket, log.try_clone().unwrap().into());
    let connections = cell["connections"].as_array().unwrap().len();
    let from_version = notes["fromVersion"].as_str().unwrap().to_string();
    let stand_in = orca_relay::threads::spawn("test-running", move || {
        let soon = || orca_relay::clock::instant() + Duration::from_secs(20);
        let (_keep, never) = wire::pair().unwrap();
        let command = giver
            .listener
            .accept(never.as_raw_fd(), soon())
            .unwrap()
            .unwrap();
        let (kind, _) = receive(&command, soon()).unwrap();
        assert_eq!(kind, Kind::Begin);
        let token = "stand-in-token";
        let accepted = Accepted {
            token: token.into(),
            pid: std::process::id(),
            version: from_version.clone(),
            running: None,
        };
        send(&command, Kind::Accepted, &accepted, soon()).unwrap();
        let handed = giver.hand_over(token, &captured, &from_version, connections + 3);
        // Committed (or not): the stand-in goes away without an outcome.
        drop(command);
        (handed, giver)
    })
    .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_orca-relay"));
    command
        .arg("handover")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .env("ORCA_RELAY_WS_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_HTTP_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_DATA_DIR", &data_dir.0)
        .env("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY)
        .env("ORCA_RELAY_CELL_ID", cell["cellId"].as_str().unwrap());
    for setting in notes["settings"].as_array().unwrap() {
        command.env(setting[0].as_str().unwrap(), setting[1].as_str().unwrap());
    }
    let output = command
        .stdin(Stdio::null())
        .output()
        .expect("run orca-relay handover");
    let (handed, _giver) = stand_in.join().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    let log_text = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(handed.is_ok(), "{handed:?}\n{stderr}\n{log_text}");
    let new_pid: u32 = stdout
        .split("-> pid ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or(0);
    // The next process that took over (or that was left to finish on its own) is killed when
    // the test ends.
    let next_pid = if new_pid > 0 {
        new_pid
    } else {
        running_next_process(&socket).unwrap_or(0)
    };
    let _serving = (next_pid > 0).then_some(Serving { pid: next_pid });
    assert_eq!(
        output.status.code(),
        Some(0),
        "stdout: {stdout}\nstderr: {stderr}\n{log_text}"
    );
    assert!(
        stdout.starts_with("handover committed: pid ") && new_pid > 0,
        "{stdout}"
    );
}

// ---------------------------------------------------------------------------------------------
// Another user's socket.

/// A directory of root's with a handover socket whose listener runs as another user (uid
/// 65534): bound as root, then `listen(2)` from a thread whose credentials are changed (a raw
/// `setresuid`, which changes the calling thread's only). The kernel records the listener's
/// credentials at `listen`: what `SO_PEERCRED` tells a client. The thread accepts for a while
/// and returns every message it received.
struct Impostor {
    dir: TempDir,
    thread: Option<std::thread::JoinHandle<Messages>>,
}

/// Messages a socket received: (kind, body).
type Messages = Vec<(u8, Vec<u8>)>;

impl Impostor {
    fn start() -> Impostor {
        let dir = TempDir::new("impostor");
        let path = orca_relay::handover::socket_path(&dir.0);
        let thread = orca_relay::threads::spawn("test-impostor", move || {
            // SAFETY: a socket(2), bind(2) and listen(2) on an address we build; the descriptor
            // is closed when the thread ends.
            let fd = unsafe {
                libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0)
            };
            assert!(fd >= 0);
            let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
            address.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (slot, byte) in address
                .sun_path
                .iter_mut()
                .zip(path.as_os_str().as_encoded_bytes())
            {
                *slot = *byte as libc::c_char;
            }
            let bound = unsafe {
                libc::bind(
                    fd,
                    &address as *const libc::sockaddr_un as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
                )
            };
            assert_eq!(bound, 0, "{}", std::io::Error::last_os_error());
            // SAFETY: a raw syscall changes this thread's credentials only.
            let changed = unsafe {
                libc::syscall(
                    libc::SYS_setresuid,
                    -1 as libc::c_long,
                    65534 as libc::c_long,
                    -1 as libc::c_long,
                )
            };
            assert_eq!(changed, 0, "{}", std::io::Error::last_os_error());
            assert_eq!(unsafe { libc::listen(fd, 8) }, 0);
            let mut received = Vec::new();
            let until = now_instant() + Duration::from_secs(8);
            while now_instant() < until {
                let mut pollfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                if unsafe { libc::poll(&mut pollfd, 1, 100) } <= 0 {
                    continue;
                }
                let client = unsafe {
                    libc::accept4(
                        fd,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC,
                    )
                };
                if client < 0 {
                    continue;
                }
                let mut buf = vec![0u8; 70_000];
                let mut pollfd = libc::pollfd {
                    fd: client,
                    events: libc::POLLIN,
                    revents: 0,
                };
                if unsafe { libc::poll(&mut pollfd, 1, 2_000) } > 0 {
                    let n = unsafe { libc::recv(client, buf.as_mut_ptr().cast(), buf.len(), 0) };
                    if n > 0 {
                        received.push((buf[0], buf[1..n as usize].to_vec()));
                    }
                }
                unsafe { libc::close(client) };
            }
            unsafe { libc::close(fd) };
            received
        })
        .unwrap();
        let socket = orca_relay::handover::socket_path(&dir.0);
        assert!(wait_until(Duration::from_secs(10), || socket.exists()));
        Impostor {
            dir,
            thread: Some(thread),
        }
    }

    fn received(mut self) -> Messages {
        self.thread.take().unwrap().join().unwrap()
    }
}

fn run_handover_command(data_dir: &Path) -> (i32, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .arg("handover")
        .env_clear()
        .env("ORCA_RELAY_DATA_DIR", data_dir)
        .stdin(Stdio::null())
        .output()
        .expect("run orca-relay handover");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

/// Starts `orca-relay run --take-over <socket>` the way the command does, its token on a line
/// of its own; waits for its exit. `(status, standard error)`.
fn run_next_process(socket: &Path, data_dir: &Path, token: &str) -> (i32, String) {
    let (mut ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let theirs_fd = theirs.as_raw_fd();
    let mut command = Command::new(env!("CARGO_BIN_EXE_orca-relay"));
    command
        .args(["run", "--take-over"])
        .arg(socket)
        .args(["--handover-fd", &theirs_fd.to_string()])
        .env_clear()
        .env("ORCA_RELAY_ROLE", "combined")
        .env("ORCA_RELAY_WS_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_HTTP_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_DATA_DIR", data_dir)
        .env("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: fcntl only, in the child before exec.
        unsafe {
            command.pre_exec(move || {
                libc::fcntl(theirs_fd, libc::F_SETFD, 0);
                Ok(())
            });
        }
    }
    let child = command.spawn().expect("start the next process");
    drop(theirs);
    ours.write_all(token.as_bytes()).unwrap();
    ours.shutdown(std::net::Shutdown::Write).unwrap();
    let output = child.wait_with_output().unwrap();
    let mut rest = String::new();
    let _ = ours.read_to_string(&mut rest);
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

/// Point 5: a handover socket whose listener is another user's (in a shared data directory,
/// another user received the handover request and the next process's token). Both clients now
/// look at the listener's credentials first and send it nothing: the command refuses with the
/// uid it found, and so does a next process. Only root can play another user (the suite runs
/// as root).
#[test]
fn a_handover_socket_of_another_user_hears_nothing() {
    // SAFETY: geteuid(2) cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test plays another user: run it as root"
    );
    let impostor = Impostor::start();
    let dir = impostor.dir.0.clone();
    let (code, stderr) = run_handover_command(&dir);
    let data_dir = TempDir::new("next");
    let secret = "a-token-nobody-else-may-read";
    let (next_code, next_stderr) = run_next_process(
        &orca_relay::handover::socket_path(&dir),
        &data_dir.0,
        secret,
    );
    let received = impostor.received();
    assert!(
        received.is_empty(),
        "the other user's socket received {} messages: {:?}",
        received.len(),
        received
            .iter()
            .map(|(kind, body)| (kind, String::from_utf8_lossy(body).to_string()))
            .collect::<Vec<_>>()
    );
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("runs as uid 65534"), "{stderr}");
    assert_eq!(next_code, 1, "{next_stderr}");
}

/// Point 5: a data directory another user controls (owned by another user, or writable by
/// others) is refused by the command before it connects.
#[test]
fn a_data_directory_another_user_controls_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let shared = TempDir::new("shared");
    std::fs::set_permissions(&shared.0, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (code, stderr) = run_handover_command(&shared.0);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("writable by other users"), "{stderr}");
    let theirs = TempDir::new("theirs");
    // SAFETY: chown(2) of the test's own directory (as root).
    let path = std::ffi::CString::new(theirs.0.as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::chown(path.as_ptr(), 65534, 65534) }, 0);
    let (code, stderr) = run_handover_command(&theirs.0);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("belongs to uid 65534"), "{stderr}");
}

// ---------------------------------------------------------------------------------------------
// A control whose write broke.

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

/// A desktop whose control reads slowly: a tiny receive buffer and small segments, so that a
/// few KiB of answers fill both sides' buffers. Returns the raw stream after its hello's ack.
fn slow_desktop(relay: &Relay) -> std::net::TcpStream {
    let relay_host_id = host_id();
    let user = format!("user-{relay_host_id}");
    let token = token(&user, &relay_host_id);
    let epoch = assign(relay, &token, &relay_host_id);
    // SAFETY: a plain socket(2); the descriptor is owned by the TcpStream made from it below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    assert!(fd >= 0);
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
    let mut stream = unsafe { <std::net::TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
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
    let hello =
        json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch});
    stream
        .write_all(&client_frame(0x81, hello.to_string().as_bytes()))
        .unwrap();
    // The ack: one small text frame.
    let mut first = [0u8; 2];
    stream.read_exact(&mut first).unwrap();
    assert_eq!(first[0], 0x81);
    let mut payload = vec![0u8; (first[1] & 0x7f) as usize];
    stream.read_exact(&mut payload).unwrap();
    assert!(String::from_utf8_lossy(&payload).contains("host-hello-ack"));
    stream
}

/// Splits server frames off `bytes`: the whole frames' (opcode, payload), and how many bytes
/// are left after the last whole one.
fn whole_frames(bytes: &[u8]) -> (Vec<(u8, Vec<u8>)>, usize) {
    let mut frames = Vec::new();
    let mut at = 0;
    loop {
        let rest = &bytes[at..];
        if rest.len() < 2 {
            break;
        }
        let (length, header) = match rest[1] & 0x7f {
            126 if rest.len() >= 4 => (u16::from_be_bytes([rest[2], rest[3]]) as usize, 4),
            127 if rest.len() >= 10 => (
                u64::from_be_bytes(rest[2..10].try_into().unwrap()) as usize,
                10,
            ),
            126 | 127 => break,
            short => (short as usize, 2),
        };
        if rest.len() < header + length {
            break;
        }
        frames.push((rest[0], rest[header..header + length].to_vec()));
        at += header + length;
    }
    (frames, bytes.len() - at)
}

/// Point 5: a control whose write timed out half-way through a frame (its desktop stopped
/// reading while `invite-create` answers piled up) when a handover begins. Its connection is
/// shut down (`relay/socket.rs`: a broken writer shuts the connection down) and never resumed
/// by the next process behind its half-written frame: whatever the desktop reads afterwards is
/// whole frames, each a JSON text, then at most the start of one frame and the end of the
/// connection. (Passes on main since issue 30; removing that shutdown fails it: the next
/// process answered the rest of the requests behind the half frame.)
#[test]
fn a_control_whose_write_broke_is_never_resumed_behind_its_half_frame() {
    handover_kit::adopt_orphans();
    let relay = Relay::combined(&[
        ("ORCA_RELAY_WEDGE_MS", "1000"),
        ("ORCA_RELAY_PING_MS", "600000"),
        ("ORCA_RELAY_SILENCE_MS", "600000"),
    ]);
    ready(&relay);
    let mut desktop = slow_desktop(&relay);
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
    // The relay stops reading once an answer's write waits: the rest of the burst stays here.
    let _ = desktop.write_all(&burst);
    let outcome = handover_kit::hand_over(&relay, None, &[], &[]);
    let _serving = outcome.new_pid.map(|pid| Serving { pid });
    assert_eq!(outcome.code, 0, "{outcome:?}\n{}", relay.log_text());
    // Everything the desktop is sent from now on, read at last.
    desktop
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut bytes = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    let ended = loop {
        match desktop.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    let (frames, left) = whole_frames(&bytes);
    for (index, (first, payload)) in frames.iter().enumerate() {
        assert_eq!(
            *first,
            0x81,
            "frame {index} of {}: not a whole text frame (a frame written behind a half one?)",
            frames.len()
        );
        assert!(
            serde_json::from_slice::<Value>(payload).is_ok(),
            "frame {index} of {}: {:?}",
            frames.len(),
            String::from_utf8_lossy(payload)
        );
    }
    assert!(
        left == 0 || ended,
        "{left} bytes of a half frame, and the connection goes on"
    );
    assert!(!frames.is_empty());
}
