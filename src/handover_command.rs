//! `orca-relay handover` (and `systemctl reload`, its `ExecReload=`): replaces the running
//! relay with the binary now on disk, without closing a connection (ARCHITECTURE.md "Live
//! handover").
//!
//! The command finds the running process through `$ORCA_RELAY_DATA_DIR/handover.sock`, asks it
//! for a handover, starts the next process (the binary on disk, or `--binary`) with the
//! command's own environment, and waits for the running process's outcome: committed (exit 0,
//! one line saying what moved and how long streams paused) or rolled back (exit 1, one line with
//! the cause). If the next process exits before it confirmed, the command tells the running
//! process at once rather than letting it wait for its 10 s; on a rollback a next process that
//! lingers is killed. Without an outcome (the running process went away without one) the next
//! process is never killed: it may own every connection; it says so on its line if it does,
//! and ends itself if it does not.
//!
//! The next process is put in a session of its own (a Ctrl-C meant for the command never
//! reaches the relay that now serves), and started as an orphan, so that systemd supervises it
//! as its own child once it is the unit's main process ([`start_next`]). Its token travels on
//! an inherited socket, never on its command line. Both sides check that the handover socket
//! is this user's (`wire::Channel::connect_trusted`). The final line says what really
//! happened, also when the running process died during the handover.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::clock;
use crate::handover::wire::{self, Channel};
use crate::handover::{self, body, receive, send, Accepted, Begin, Cause, Kind, Outcome};

/// The command's options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandoverOptions {
    /// The binary to start (default: the one this command runs from, i.e. the one on disk).
    pub binary: Option<PathBuf>,
    /// A fault the next process fakes (tests only).
    pub test_fault: Option<String>,
}

impl HandoverOptions {
    pub fn parse(args: &[String]) -> Result<HandoverOptions, String> {
        let mut options = HandoverOptions::default();
        let mut iter = args.iter();
        while let Some(arg) = iter.next() {
            let mut value = |name: &str| {
                iter.next()
                    .cloned()
                    .ok_or_else(|| format!("{name} needs a value"))
            };
            match arg.as_str() {
                "--binary" => options.binary = Some(PathBuf::from(value("--binary")?)),
                "--test-fault" => {
                    let fault = value("--test-fault")?;
                    if crate::roles::handover::Fault::parse(&fault).is_none() {
                        return Err(format!("unknown --test-fault {fault:?}"));
                    }
                    options.test_fault = Some(fault);
                }
                other => return Err(format!("unexpected argument {other:?}")),
            }
        }
        Ok(options)
    }
}

/// How long the command waits for the outcome: the running process's own limit, plus the
/// start of the next process and a margin.
const OUTCOME_WAIT: Duration = Duration::from_secs(20);

/// The data directory as `run` reads it (`''` is unset), without the rest of the configuration:
/// a configuration the next process refuses is reported by it, through the running process.
pub fn data_dir_from(lookup: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    lookup("ORCA_RELAY_DATA_DIR")
        .filter(|dir| !dir.trim().is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("./data"))
}

/// How the command's attempt ended: the line it prints and its exit code.
#[derive(Debug)]
enum Ending {
    /// The running process said it committed.
    Committed { from_pid: u32, outcome: Outcome },
    /// The running process went away without telling, but the next process says it was
    /// committed and serves.
    CommittedUntold { from_pid: u32, to_pid: u32 },
    /// The running process says it rolled back: it keeps serving.
    RolledBack(String),
    /// Nothing was handed (no relay answered, or it refused): the running relay, if any, is
    /// as it was.
    NotStarted(String),
    /// Anything else: the line says what is known of each process.
    Failed(String),
}

/// Runs the command; prints one line (what really happened); returns the exit code.
pub fn run(options: &HandoverOptions) -> i32 {
    // A data directory that is not UTF-8 is refused as `run` refuses it (SPEC §13), not read
    // as unset (which would look for the running relay in `./data`).
    if std::env::var_os("ORCA_RELAY_DATA_DIR").is_some_and(|dir| dir.to_str().is_none()) {
        eprintln!(
            "orca-relay handover: failed before asking the running relay: invalid ORCA_RELAY_DATA_DIR: the value is not valid UTF-8"
        );
        return 1;
    }
    let data_dir = data_dir_from(&|name| std::env::var(name).ok());
    let ending = hand_over(options, &handover::socket_path(&data_dir), UNKNOWN_WAIT);
    let (line, code) = describe(&ending);
    if code == 0 {
        println!("{line}");
    } else {
        eprintln!("{line}");
    }
    code
}

/// The command's one line and exit code for an ending.
fn describe(ending: &Ending) -> (String, i32) {
    match ending {
        Ending::Committed { from_pid, outcome } => (
            format!(
                "handover committed: pid {from_pid} -> pid {} ({}), {} connections and {} spliced pairs moved, streams paused {} ms, {} ms in all",
                outcome.new_pid.unwrap_or(0),
                outcome.new_version.as_deref().unwrap_or("?"),
                outcome.connections,
                outcome.pairs,
                outcome.paused_ms,
                outcome.took_ms
            ),
            0,
        ),
        Ending::CommittedUntold { from_pid, to_pid } => (
            format!(
                "handover committed: pid {from_pid} -> pid {to_pid} (the new process says so; the running relay exited without reporting what moved)"
            ),
            0,
        ),
        Ending::RolledBack(cause) => (
            format!("orca-relay handover: failed, the running relay keeps serving: {cause}"),
            1,
        ),
        Ending::NotStarted(cause) => (format!("orca-relay handover: failed: {cause}"), 1),
        Ending::Failed(what) => (format!("orca-relay handover: failed: {what}"), 1),
    }
}

/// How long the command waits for the next process's word once the running one went away
/// without an outcome: the next process's own limit (it ends itself when nobody commits it)
/// and a margin.
const UNKNOWN_WAIT: Duration = Duration::from_secs(22);

fn hand_over(options: &HandoverOptions, socket: &Path, unknown_wait: Duration) -> Ending {
    let deadline = clock::instant() + Duration::from_secs(5);
    let command = match Channel::connect_trusted(socket, deadline) {
        Ok(command) => command,
        Err(wire::WireError::Untrusted(why)) => return Ending::NotStarted(why),
        Err(e) => {
            return Ending::NotStarted(format!(
            "no running relay answers at {} ({e}); is it running with this ORCA_RELAY_DATA_DIR?",
            socket.display()
        ))
        }
    };
    let begin = Begin {
        pid: std::process::id(),
        version: handover::version(),
    };
    if let Err(e) = send(&command, Kind::Begin, &begin, deadline) {
        return Ending::NotStarted(format!("cannot ask the running relay: {e}"));
    }
    let accepted: Accepted = match receive(&command, deadline) {
        Ok((Kind::Accepted, message)) => match body(&message) {
            Ok(accepted) => accepted,
            Err(e) => return Ending::NotStarted(format!("the running relay's answer: {e}")),
        },
        Ok((Kind::Refused, message)) => {
            let cause = body::<Cause>(&message)
                .map(|cause| cause.cause)
                .unwrap_or_else(|e| e.to_string());
            return Ending::RolledBack(format!("refused: {cause}"));
        }
        Ok(_) => {
            return Ending::NotStarted("the running relay answered something unexpected".into())
        }
        Err(e) => return Ending::NotStarted(format!("no answer from the running relay: {e}")),
    };
    // Watched from here: whether the running process is still alive when it goes quiet.
    let running = ProcessHandle::open(accepted.pid);
    let mut next = match start_next(options, socket, &accepted) {
        Ok(next) => next,
        Err(cause) => {
            // The running process waits for a next process that will never come: tell it.
            let _ = send(
                &command,
                Kind::Abort,
                &Cause {
                    token: None,
                    cause: cause.clone(),
                },
                clock::instant() + Duration::from_secs(1),
            );
            return match wait_for_outcome(&command, None) {
                Ok(outcome) if !outcome.committed => {
                    Ending::RolledBack(outcome.cause.unwrap_or(cause))
                }
                _ => Ending::Failed(cause),
            };
        }
    };
    match wait_for_outcome(&command, Some(&mut next)) {
        Ok(outcome) if outcome.committed => Ending::Committed {
            from_pid: accepted.pid,
            outcome,
        },
        Ok(outcome) => {
            // Rolled back: the next process was told to exit; one that lingers is killed.
            next.stop();
            Ending::RolledBack(outcome.cause.unwrap_or_else(|| "no cause given".into()))
        }
        // No outcome (the running process went away, or said nothing in time): it may have
        // committed, and then the next process owns every connection. It is never killed: the
        // next process itself says whether it was committed (or ends without a word when it
        // was not, on a closed socket or its own deadline).
        Err(cause) => match next.wait_for_word(unknown_wait) {
            NextWord::Committed => Ending::CommittedUntold {
                from_pid: accepted.pid,
                to_pid: next.pid,
            },
            NextWord::Ended => {
                let died = running
                    .as_ref()
                    .is_some_and(|running| running.exited_within(Duration::from_secs(1)));
                let (running, serving) = if died {
                    (
                        "died during the handover",
                        "no relay serves now (under systemd, Restart= starts one)",
                    )
                } else {
                    (
                        "is still running but ended the handover without an outcome",
                        "what it serves is unknown; see its log",
                    )
                };
                Ending::Failed(format!(
                    "the running relay (pid {}) {running} ({cause}); the new process (pid {}) exited without taking over: {serving}",
                    accepted.pid, next.pid
                ))
            }
            NextWord::Silent => Ending::Failed(format!(
                "{cause}; the outcome is unknown: the new process (pid {}) was left to finish on its own",
                next.pid
            )),
        },
    }
}

/// A process this command watches without being its parent: a `pidfd`, which keeps naming
/// that process even after it exits (no pid reuse can fool it).
struct ProcessHandle {
    fd: std::os::fd::OwnedFd,
}

impl ProcessHandle {
    fn open(pid: u32) -> Option<ProcessHandle> {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open(2) with a pid and no flags; the result is checked.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor nothing else owns.
        Some(ProcessHandle {
            fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as RawFd) },
        })
    }

    /// Whether the process has exited, waiting up to `timeout` for it to.
    fn exited_within(&self, timeout: Duration) -> bool {
        matches!(
            wire::wait_readable(&[self.fd.as_raw_fd()], clock::instant() + timeout),
            Ok(ready) if ready.first().copied().unwrap_or(false)
        )
    }
}

/// The next process as the command knows it: its pid and the command's line to it (a unix
/// socket whose other end only the next process holds: the token goes down it, the word
/// `committed` comes back, and its end of stream means the next process is gone).
struct Next {
    pid: u32,
    line: UnixStream,
    /// What the next process said so far.
    heard: NextWord,
}

/// What the next process said on its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NextWord {
    /// Nothing yet (it is still running).
    Silent,
    /// It was committed: it owns every connection.
    Committed,
    /// Its end of the line closed without the word: it exited (or will at once).
    Ended,
}

impl Next {
    /// Reads what has arrived on the line (without waiting).
    fn listen(&mut self) -> NextWord {
        if self.heard != NextWord::Silent {
            return self.heard;
        }
        let mut buf = [0u8; 64];
        loop {
            match (&self.line).read(&mut buf) {
                Ok(0) => {
                    self.heard = NextWord::Ended;
                    break;
                }
                // The only word the next process writes (`handover::COMMITTED_WORD`).
                Ok(_) => {
                    self.heard = NextWord::Committed;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.heard = NextWord::Ended;
                    break;
                }
            }
        }
        self.heard
    }

    /// Waits up to `timeout` for the next process to say it was committed or to end.
    fn wait_for_word(&mut self, timeout: Duration) -> NextWord {
        let deadline = clock::instant() + timeout;
        loop {
            let word = self.listen();
            if word != NextWord::Silent {
                return word;
            }
            if wire::wait_readable(&[self.line.as_raw_fd()], deadline).is_err() {
                return self.listen();
            }
        }
    }

    /// A next process that did not take over: given a second to exit on its own (it was
    /// told), then killed. (It is not this command's child: whoever reaps orphans reaps it.)
    fn stop(&mut self) {
        if self.wait_for_word(Duration::from_secs(1)) == NextWord::Silent {
            // SAFETY: kill(2) on the next process, whose end of the line is still open, so it
            // is still that process.
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

/// Starts the next process: the binary, with this command's environment, in a session of its
/// own, its output where this command's goes until it adopts the running process's.
///
/// It is started through an intermediate process that forks it and exits at once, so the
/// next process is an orphan before it does anything: its parent is whoever reaps orphans,
/// under systemd the service manager itself. The running process later names it the unit's
/// main process (`MAINPID=`), and systemd supervises only a main process that is its own
/// child: one that is not ("Supervising process N which is not our child") is not waited for
/// on `systemctl stop`, and with nothing else in the unit's cgroup systemd sends SIGKILL
/// right after SIGTERM: no drain. The next process waits for its token on its line, which
/// this command writes only after it has reaped the intermediate process, so it cannot say
/// `ready` (and be named main) before it has been re-parented. The token never appears on a
/// command line (anyone can read `/proc/<pid>/cmdline`).
fn start_next(
    options: &HandoverOptions,
    socket: &Path,
    accepted: &Accepted,
) -> Result<Next, String> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let binary = match &options.binary {
        Some(binary) => binary.clone(),
        None => {
            std::env::current_exe().map_err(|e| format!("cannot find the binary on disk: {e}"))?
        }
    };
    let (line, theirs) =
        UnixStream::pair().map_err(|e| format!("cannot make the next process's line: {e}"))?;
    let mut pipe = [0; 2];
    // SAFETY: pipe2(2) writes two descriptors into the array.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!(
            "cannot make a pipe: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: two fresh descriptors, owned here.
    let (pid_read, pid_write) =
        unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    let theirs_fd = theirs.as_raw_fd();
    let pid_write_fd = pid_write.as_raw_fd();
    let mut command = Command::new(&binary);
    command
        .arg("run")
        .arg("--take-over")
        .arg(socket)
        .arg("--handover-fd")
        .arg(theirs_fd.to_string())
        // Its standard error is this command's until it adopts the running process's; its
        // standard output is nobody's (a caller reading this command's output to its end must
        // not wait for the relay).
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    if let Some(fault) = &options.test_fault {
        command.arg("--test-fault").arg(fault);
    }
    // What the running process is and listens on: the next one refuses, before it says
    // `ready`, another cell or an address it would not hold (a changed listening address needs
    // a restart).
    if let Some(running) = &accepted.running {
        command.arg("--running").arg(running.to_arg());
    }
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: runs in the forked intermediate process before exec, and only calls
        // async-signal-safe functions (fork, write, _exit, setsid, fcntl).
        unsafe {
            command.pre_exec(move || {
                let pid = libc::fork();
                if pid < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if pid > 0 {
                    // The intermediate process: tell the command the next one's pid, and go.
                    let bytes = (pid as u32).to_ne_bytes();
                    libc::write(pid_write_fd, bytes.as_ptr() as *const libc::c_void, 4);
                    libc::_exit(0);
                }
                // The next process: a session of its own (a Ctrl-C meant for the command
                // never reaches the relay that now serves), and its end of the line kept
                // across exec.
                libc::setsid();
                if libc::fcntl(theirs_fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let spawned = command.spawn();
    drop(pid_write);
    drop(theirs);
    let mut intermediate =
        spawned.map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
    // Reaped: the next process is an orphan now.
    let _ = intermediate.wait();
    let mut bytes = [0u8; 4];
    let mut pid_read = std::fs::File::from(pid_read);
    pid_read
        .read_exact(&mut bytes)
        .map_err(|e| format!("cannot start {}: no process ({e})", binary.display()))?;
    let pid = u32::from_ne_bytes(bytes);
    let mut writer = &line;
    let sent = writer
        .write_all(accepted.token.as_bytes())
        .and_then(|()| line.shutdown(std::net::Shutdown::Write))
        .and_then(|()| line.set_nonblocking(true));
    // A line that cannot be written is one whose other end is gone: the next process exited
    // already (the running process is told so, as for any exit before confirming).
    let heard = if sent.is_ok() {
        NextWord::Silent
    } else {
        NextWord::Ended
    };
    Ok(Next { pid, line, heard })
}

/// Waits for the running process's outcome, telling it at once if the next process exits
/// before the outcome.
fn wait_for_outcome(command: &Channel, mut next: Option<&mut Next>) -> Result<Outcome, String> {
    let deadline = clock::instant() + OUTCOME_WAIT;
    let mut aborted = false;
    loop {
        if let Some(next) = next.as_deref_mut() {
            if !aborted && next.listen() == NextWord::Ended {
                aborted = true;
                let cause = format!(
                    "the new process (pid {}) exited before confirming",
                    next.pid
                );
                let _ = send(
                    command,
                    Kind::Abort,
                    &Cause { token: None, cause },
                    clock::instant() + Duration::from_secs(1),
                );
            }
        }
        let mut watched = vec![command.as_raw_fd()];
        // The line only until the next process has said its word (or ended): an ended line
        // stays readable.
        if let Some(next) = next
            .as_deref()
            .filter(|next| next.heard == NextWord::Silent)
        {
            watched.push(next.line.as_raw_fd());
        }
        match wire::wait_readable(&watched, deadline) {
            Ok(ready) if ready[0] => {
                match receive(command, clock::instant() + Duration::from_secs(1)) {
                    Ok((Kind::Outcome, message)) => {
                        return body(&message).map_err(|e| e.to_string())
                    }
                    Ok(_) => return Err("the running relay answered something unexpected".into()),
                    Err(wire::WireError::TimedOut) => {}
                    Err(e) => {
                        return Err(format!(
                            "the running relay went away without an outcome: {e}"
                        ))
                    }
                }
            }
            Ok(_) => {}
            Err(wire::WireError::TimedOut) => {
                return Err(format!(
                    "no outcome from the running relay within {} s",
                    OUTCOME_WAIT.as_secs()
                ))
            }
            Err(e) => return Err(format!("waiting for the running relay failed: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() {
        let args = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            HandoverOptions::parse(&args(&[])),
            Ok(HandoverOptions::default())
        );
        assert_eq!(
            HandoverOptions::parse(&args(&["--binary", "/usr/bin/orca-relay"])),
            Ok(HandoverOptions {
                binary: Some("/usr/bin/orca-relay".into()),
                test_fault: None
            })
        );
        assert!(HandoverOptions::parse(&args(&["--test-fault", "bogus"])).is_err());
        assert!(HandoverOptions::parse(&args(&["--binary"])).is_err());
        assert!(HandoverOptions::parse(&args(&["extra"])).is_err());
    }

    /// The running process went away after `begin` without telling the command how it ended
    /// (it exits 0 right after sending `committed`, so this is what a commit whose outcome line
    /// was lost looks like). The next process may own every connection then: the command must
    /// not kill it (a next process that was not committed ends itself: it reads a closed
    /// socket). Before: the command killed it, so a committed handover served nobody.
    #[test]
    fn a_next_process_is_not_killed_when_the_outcome_is_unknown() {
        let dir = std::env::temp_dir().join(format!("orca-handover-cmd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let pid_file = dir.join("next.pid");
        let script = dir.join("next.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho $$ > {}\nexec sleep 30\n",
                pid_file.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let socket = dir.join("handover.sock");
        let listener = wire::Listener::bind(&socket).unwrap();
        let running = {
            let pid_file = pid_file.clone();
            crate::threads::spawn("test-running", move || {
                let soon = || clock::instant() + Duration::from_secs(5);
                let (idle, _keep) = wire::pair().unwrap();
                let command = listener.accept(idle.as_raw_fd(), soon()).unwrap().unwrap();
                let (kind, _) = receive(&command, soon()).unwrap();
                assert_eq!(kind, Kind::Begin);
                let accepted = Accepted {
                    token: "t".into(),
                    pid: std::process::id(),
                    version: handover::version(),
                    running: None,
                };
                send(&command, Kind::Accepted, &accepted, soon()).unwrap();
                // The next process has started; the running one goes away without a word.
                let deadline = soon();
                while std::fs::read_to_string(&pid_file).map_or(true, |s| !s.ends_with('\n')) {
                    assert!(
                        clock::instant() < deadline,
                        "the next process did not start"
                    );
                    clock::sleep(Duration::from_millis(10));
                }
                drop(command);
            })
            .unwrap()
        };
        let options = HandoverOptions {
            binary: Some(script),
            test_fault: None,
        };
        let result = hand_over(&options, &socket, Duration::from_millis(300));
        running.join().unwrap();
        let pid: libc::pid_t = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // SAFETY: signal 0 only asks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        // SAFETY: the test's own child: killed and reaped, whatever the outcome.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            matches!(&result, Ending::Failed(what) if what.contains("left to finish on its own")),
            "no outcome came, and the next process said nothing: {result:?}"
        );
        assert!(
            alive,
            "the next process was killed though the outcome was unknown"
        );
    }

    #[test]
    fn the_data_dir_is_read_like_run_reads_it() {
        let env = |value: Option<&'static str>| move |_: &str| value.map(str::to_string);
        assert_eq!(data_dir_from(&env(None)), PathBuf::from("./data"));
        assert_eq!(data_dir_from(&env(Some(""))), PathBuf::from("./data"));
        assert_eq!(
            data_dir_from(&env(Some("/var/lib/x"))),
            PathBuf::from("/var/lib/x")
        );
    }
}
