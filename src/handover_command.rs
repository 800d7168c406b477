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
//! process is never killed: it may own every connection; if it does not, it ends itself.
//!
//! The next process is put in a session of its own: a Ctrl-C meant for the command never
//! reaches the relay that now serves.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

/// Runs the command; prints one line; returns the exit code.
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
    match hand_over(options, &handover::socket_path(&data_dir)) {
        Ok(outcome) => {
            println!(
                "handover committed: pid {} -> pid {} ({}), {} connections and {} spliced pairs moved, streams paused {} ms, {} ms in all",
                outcome.0,
                outcome.1.new_pid.unwrap_or(0),
                outcome.1.new_version.as_deref().unwrap_or("?"),
                outcome.1.connections,
                outcome.1.pairs,
                outcome.1.paused_ms,
                outcome.1.took_ms
            );
            0
        }
        Err(cause) => {
            eprintln!("orca-relay handover: failed, the running relay keeps serving: {cause}");
            1
        }
    }
}

fn hand_over(options: &HandoverOptions, socket: &Path) -> Result<(u32, Outcome), String> {
    let deadline = clock::instant() + Duration::from_secs(5);
    let command = Channel::connect(socket, deadline).map_err(|e| {
        format!(
            "no running relay answers at {} ({e}); is it running with this ORCA_RELAY_DATA_DIR?",
            socket.display()
        )
    })?;
    let begin = Begin {
        pid: std::process::id(),
        version: handover::version(),
    };
    send(&command, Kind::Begin, &begin, deadline).map_err(|e| format!("cannot ask: {e}"))?;
    let accepted: Accepted = match receive(&command, deadline) {
        Ok((Kind::Accepted, message)) => body(&message).map_err(|e| e.to_string())?,
        Ok((Kind::Refused, message)) => {
            let cause: Cause = body(&message).map_err(|e| e.to_string())?;
            return Err(format!("refused: {}", cause.cause));
        }
        Ok(_) => return Err("the running relay answered something unexpected".into()),
        Err(e) => return Err(format!("no answer from the running relay: {e}")),
    };
    let mut child = start_next(options, socket, &accepted)?;
    let outcome = wait_for_outcome(&command, &mut child);
    match &outcome {
        // Rolled back: the next process was told to exit; one that lingers is killed.
        Ok(outcome) if !outcome.committed => stop_next(&mut child),
        Ok(_) => {}
        // No outcome (the running process went away, or said nothing in time): it may have
        // committed, and then the next process owns every connection. It is left alone: one
        // that was not committed ends itself (a closed socket or its own deadline).
        Err(_) => {}
    }
    let outcome = outcome.map_err(|cause| {
        format!(
            "{cause}; the outcome is unknown: the new process (pid {}) was left to finish on its own",
            child.id()
        )
    })?;
    if outcome.committed {
        Ok((accepted.pid, outcome))
    } else {
        Err(outcome.cause.unwrap_or_else(|| "no cause given".into()))
    }
}

/// Starts the next process: the binary, with this command's environment, in a session of its
/// own, its output where this command's goes until it adopts the running process's.
fn start_next(
    options: &HandoverOptions,
    socket: &Path,
    accepted: &Accepted,
) -> Result<Child, String> {
    let binary = match &options.binary {
        Some(binary) => binary.clone(),
        None => {
            std::env::current_exe().map_err(|e| format!("cannot find the binary on disk: {e}"))?
        }
    };
    let mut command = Command::new(&binary);
    command
        .arg("run")
        .arg("--take-over")
        .arg(socket)
        .arg("--token")
        .arg(&accepted.token)
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
        // SAFETY: setsid is async-signal-safe; it only runs in the child before exec.
        unsafe {
            command.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
    }
    command
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary.display()))
}

/// Waits for the running process's outcome, telling it at once if the next process exits
/// before the outcome.
fn wait_for_outcome(command: &Channel, child: &mut Child) -> Result<Outcome, String> {
    let deadline = clock::instant() + OUTCOME_WAIT;
    let mut aborted = false;
    loop {
        let slice = (clock::instant() + Duration::from_millis(100)).min(deadline);
        match receive(command, slice) {
            Ok((Kind::Outcome, message)) => return body(&message).map_err(|e| e.to_string()),
            Ok(_) => return Err("the running relay answered something unexpected".into()),
            Err(wire::WireError::TimedOut) => {}
            Err(e) => {
                return Err(format!(
                    "the running relay went away without an outcome: {e}"
                ))
            }
        }
        if clock::instant() >= deadline {
            return Err(format!(
                "no outcome from the running relay within {} s",
                OUTCOME_WAIT.as_secs()
            ));
        }
        if !aborted {
            if let Ok(Some(status)) = child.try_wait() {
                aborted = true;
                let cause = match status.code() {
                    Some(code) => {
                        format!("the new process exited with status {code} before confirming")
                    }
                    None => "the new process was killed before confirming".to_string(),
                };
                let _ = send(
                    command,
                    Kind::Abort,
                    &Cause { token: None, cause },
                    clock::instant() + Duration::from_secs(1),
                );
            }
        }
    }
}

/// A next process that did not take over: given a second to exit on its own (it was told),
/// then killed, and reaped.
fn stop_next(child: &mut Child) {
    let deadline = clock::instant() + Duration::from_secs(1);
    while clock::instant() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        clock::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
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
        let result = hand_over(&options, &socket);
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
            result.is_err(),
            "no outcome came: not a commit as far as the command knows"
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
