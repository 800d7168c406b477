//! A stand-in for the service manager (what the crash tests and the nemesis need of systemd):
//! a notify socket that receives the relay's datagrams (`READY=1`, `WATCHDOG=1`, `STATUS=`) and
//! plays the descriptor store (`FDSTORE=1` with `FDNAME=`, descriptors by `SCM_RIGHTS`,
//! duplicates of one socket kept once; `FDSTOREREMOVE=1` forgets every descriptor of a name);
//! and a launcher that starts the relay as systemd restarts a unit: the stored descriptors from
//! 3 on, `LISTEN_FDS`, `LISTEN_FDNAMES`, and `LISTEN_PID` naming the relay's own pid.

use std::collections::HashSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Relay, TempDir};

/// The most descriptors one datagram carries (systemd's limit: 253).
const MAX_FDS: usize = 253;

#[derive(Default)]
struct State {
    store: Vec<(String, OwnedFd)>,
    /// Every datagram's first line that is not a store operation (`READY=1`, `WATCHDOG=1`, …).
    notes: Vec<String>,
}

/// The fake manager; its thread lives as long as the test process.
pub struct Manager {
    path: PathBuf,
    state: Arc<Mutex<State>>,
    _dir: Arc<TempDir>,
}

fn identity(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: fstat into a struct we own.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut stat) } != 0 {
        return None;
    }
    Some((stat.st_dev, stat.st_ino))
}

/// One datagram and the descriptors it carried.
fn receive(socket: &UnixDatagram) -> std::io::Result<(String, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; 8192];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a pure size computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) };
    let mut control = vec![0u64; (space as usize).div_ceil(8)];
    // SAFETY: plain old data; the buffers outlive the call.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = space as _;
    let received = loop {
        // SAFETY: a message header whose buffers are live.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut header, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into our buffer.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&header);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    let mut fd: RawFd = 0;
                    std::ptr::copy_nonoverlapping(
                        data.add(i * std::mem::size_of::<RawFd>()),
                        (&mut fd as *mut RawFd).cast::<u8>(),
                        std::mem::size_of::<RawFd>(),
                    );
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&header, cmsg);
        }
    }
    Ok((String::from_utf8_lossy(&buf[..received]).into_owned(), fds))
}

impl Manager {
    pub fn start() -> Manager {
        let dir = Arc::new(TempDir::new("manager"));
        let path = dir.0.join("notify.sock");
        let socket = UnixDatagram::bind(&path).expect("bind the notify socket");
        let state = Arc::new(Mutex::new(State::default()));
        {
            let state = state.clone();
            orca_relay::threads::spawn("test-manager", move || loop {
                let Ok((message, fds)) = receive(&socket) else {
                    return;
                };
                let field = |key: &str| {
                    message
                        .lines()
                        .find_map(|line| line.strip_prefix(key))
                        .map(str::to_string)
                };
                let name = field("FDNAME=").unwrap_or_else(|| "stored".into());
                let mut state = state.lock().unwrap();
                if field("FDSTORE=").as_deref() == Some("1") {
                    for fd in fds {
                        let known = identity(fd.as_raw_fd());
                        let duplicate = state
                            .store
                            .iter()
                            .any(|(_, kept)| identity(kept.as_raw_fd()) == known);
                        if !duplicate {
                            state.store.push((name.clone(), fd));
                        }
                    }
                } else if field("FDSTOREREMOVE=").as_deref() == Some("1") {
                    state.store.retain(|(kept, _)| *kept != name);
                } else {
                    let first = message.lines().next().unwrap_or("").to_string();
                    state.notes.push(first);
                }
            })
            .expect("start the manager's thread");
        }
        Manager {
            path,
            state,
            _dir: dir,
        }
    }

    pub fn notify_socket(&self) -> String {
        self.path.display().to_string()
    }

    /// The names of the stored descriptors, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .state
            .lock()
            .unwrap()
            .store
            .iter()
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// The stored connections' names (`c<id>`).
    pub fn connections(&self) -> HashSet<String> {
        self.names()
            .into_iter()
            .filter(|name| name.starts_with('c') && name[1..].chars().all(|c| c.is_ascii_digit()))
            .collect()
    }

    /// How many datagrams said `note` (e.g. `READY=1`).
    pub fn count_notes(&self, note: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .notes
            .iter()
            .filter(|n| n.as_str() == note)
            .count()
    }

    /// Waits until `check` holds for the store's names.
    pub fn wait_until(&self, timeout: Duration, mut check: impl FnMut(&[String]) -> bool) -> bool {
        super::wait_until(timeout, || check(&self.names()))
    }

    /// Starts the relay under this manager (`NOTIFY_SOCKET`), handing it every stored
    /// descriptor as systemd hands them at a restart.
    pub fn launch(&self, data_dir: Arc<TempDir>, env: &[(&str, &str)]) -> Relay {
        let binary = Path::new(env!("CARGO_BIN_EXE_orca-relay"));
        self.launch_binary(binary, data_dir, env)
    }

    /// As [`Manager::launch`] with another build of the binary.
    pub fn launch_binary(
        &self,
        binary: &Path,
        data_dir: Arc<TempDir>,
        env: &[(&str, &str)],
    ) -> Relay {
        use std::os::unix::process::CommandExt;
        let (names, fds): (Vec<String>, Vec<RawFd>) = {
            let state = self.state.lock().unwrap();
            state
                .store
                .iter()
                .map(|(name, fd)| {
                    // SAFETY: a close-on-exec copy of a descriptor the store holds (no other
                    // child spawned meanwhile inherits it); only its dup2 into 3.. reaches
                    // the relay, as systemd passes descriptors, with no stray copy beside it.
                    let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
                    (name.clone(), copy)
                })
                .unzip()
        };
        let listen_fds = fds.len().to_string();
        let listen_names = names.join(":");
        let notify = self.notify_socket();
        let mut env: Vec<(&str, &str)> = env.to_vec();
        env.push(("NOTIFY_SOCKET", &notify));
        if !fds.is_empty() {
            env.push(("LISTEN_FDS", &listen_fds));
            env.push(("LISTEN_FDNAMES", &listen_names));
        }
        let moved = fds.clone();
        let relay = Relay::launch_binary_with(Path::new("/bin/sh"), data_dir, &env, |command| {
            // `sh` names its own pid, then becomes the relay (same pid): LISTEN_PID is the
            // relay's, as systemd sets it.
            command
                .arg("-c")
                .arg("export LISTEN_PID=$$; exec \"$0\"")
                .arg(binary);
            let count = moved.len() as RawFd;
            // SAFETY: between fork and exec only fcntl and dup2, which are async-signal-safe.
            unsafe {
                command.pre_exec(move || {
                    // First out of the way (above the target range), then into 3, 4, … (dup2
                    // clears close-on-exec on the target; the copies close at the exec).
                    let mut high = Vec::with_capacity(moved.len());
                    for fd in &moved {
                        let copy = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 3 + count);
                        if copy < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        high.push(copy);
                    }
                    for (i, fd) in high.iter().enumerate() {
                        if libc::dup2(*fd, 3 + i as RawFd) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        });
        for fd in fds {
            // SAFETY: our own duplicates, handed to the child.
            unsafe { libc::close(fd) };
        }
        relay
    }
}
