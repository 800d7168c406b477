//! A real systemd as PID 1 of private namespaces, for black-box tests of the package as an
//! operator meets it: the `.deb` installed with `dpkg -i` (maintainer scripts included: the
//! sysusers user, `daemon-reload`), the shipped units started, stopped and signalled with
//! `systemctl`, their logs read with `journalctl`.
//!
//! [`Namespace::boot`] starts `unshare --pid --fork --mount --mount-proc --uts --ipc --net
//! --cgroup` in a cgroup of its own (the cgroup namespace's root, so the inner manager owns a
//! cgroup2 tree), on a fresh pty (the inner `/dev/console`). Its first process, the future
//! PID 1, is a shell that waits on a pipe while this module prepares its mount namespace from
//! outside with `nsenter … mount`:
//! - `/proc/sys`, `/proc/sysrq-trigger` and `/sys` read-only, a private cgroup2 mount;
//! - a tmpfs at `/srv` for everything the namespace writes, and **overlays** on `/etc`, `/usr`
//!   and `/var` (and `/lib`, `/bin`, … where they are not links into `/usr`) whose upper
//!   layers live in that tmpfs: the namespaces share the host's root filesystem, so without
//!   them `systemd-sysusers` would write the host's `/etc/passwd`, `dpkg` the host's `/usr/bin`
//!   and dpkg database, and `StateDirectory=` the host's `/var/lib`. With them the package
//!   installs as on a fresh VM and the host is untouched (nothing of it lasts beyond the
//!   namespace: the tmpfs goes with it);
//! - tmpfs on `/tmp` (`PrivateTmp=` directories), `/run` and `/etc/systemd/system` (the host's
//!   enabled units stay out), a private `/dev` (device nodes bound from the host, a new
//!   `devpts`, the pty as console);
//! - the unit search path is `/srv/units` (stub targets and the distribution's journald
//!   units, [`units`]) and `/etc/systemd/system`, where [`Namespace::link_unit`] links an
//!   installed unit (`systemctl link`): nothing of the host's boot starts. Generators are off.
//!
//! Then the shell execs `/lib/systemd/systemd --system` (without `CAP_SYS_BOOT` and
//! `CAP_SYS_MODULE`), and `boot` returns once `systemctl is-system-running --wait` says
//! `running` (a fraction of a second). Two namespaces run side by side.
//!
//! Inside, `127.0.0.1` is the namespace's own loopback. [`Namespace::command`] runs a command
//! in all the namespaces (`systemctl`, `journalctl`, `dpkg`, `kill` with the namespace's pids);
//! the test process reaches services through sockets opened by a thread that joined the
//! namespace's network ([`Namespace::connect`], [`Namespace::listen`]).
//!
//! [`Namespace::stop`] (and `Drop`, so also when a test panics) kills PID 1 (the kernel then
//! kills every process of the pid namespace), waits for the cgroup to empty and removes it.
//! Boot and drop a namespace on the same thread: `unshare` gets SIGKILL when the thread that
//! started it ends (`PR_SET_PDEATHSIG`), and kills its namespace with it (`--kill-child`), so
//! not even a test process killed mid-test leaves a manager behind.
//!
//! The machine needs root, util-linux (`unshare`, `nsenter`, `setpriv`, `runuser`, `mount`),
//! systemd's binaries and overlayfs; [`preflight`] fails in one line naming what to install
//! (`scripts/test` installs it). Tested with systemd 252 (Debian 12) on hybrid cgroups:
//! `MemoryMax=`, `TasksMax=` and `CPUQuota=` are accepted but not enforced there (no cgroup v2
//! controllers), there is no D-Bus system bus (`systemd-run` fails; `systemctl`, `journalctl`
//! and `systemd-analyze` talk to the manager's private socket).

#![allow(dead_code)]

pub mod deb;
pub mod journal;
pub mod package;
pub mod postgres;
mod units;

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

pub use journal::Entry;

/// How long one command inside may run before it is killed (`timeout`).
const COMMAND_DEADLINE: Duration = Duration::from_secs(120);
/// How long the manager may take to boot.
const BOOT_DEADLINE: Duration = Duration::from_secs(60);
/// `PATH` inside the namespace.
const INNER_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";
/// Where the namespace's own tmpfs is mounted (inside only; `/srv` exists on every FHS system).
const STATE_ROOT: &str = "/srv";
/// The systemd binary started as PID 1.
const SYSTEMD: &str = "/lib/systemd/systemd";
/// PID 1 before the manager: waits for the go byte on descriptor 3, then execs the manager.
const INIT_SCRIPT: &str = "read -r go <&3 || exit 1; exec 3<&-; exec \"$@\"";

// ---------------------------------------------------------------------------------------------
// What the machine needs

/// (what, where it comes from on Debian) for every program the harness runs.
const PROGRAMS: &[(&str, &str)] = &[
    ("unshare", "util-linux"),
    ("nsenter", "util-linux"),
    ("setpriv", "util-linux"),
    ("runuser", "util-linux"),
    ("mount", "mount"),
    ("umount", "mount"),
    ("timeout", "coreutils"),
    ("systemctl", "systemd"),
    ("journalctl", "systemd"),
    ("systemd-analyze", "systemd"),
    ("dpkg", "dpkg"),
];

/// Whether this machine can run the systemd tests; `Err` is one line saying what is missing
/// and how to install it.
pub fn preflight() -> Result<(), String> {
    let refuse = |what: &str, remedy: &str| {
        format!("systemd tests cannot run on this machine: {what}; {remedy}")
    };
    let install = |package: &str| format!("apt-get install {package} (scripts/test installs it)");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(refuse(
            "they need root (namespaces, mounts, cgroups)",
            "run them as root, as scripts/test does",
        ));
    }
    for (program, package) in PROGRAMS {
        if find_program(program).is_none() {
            return Err(refuse(
                &format!("{program} is not on PATH"),
                &install(package),
            ));
        }
    }
    for file in [SYSTEMD, "/lib/systemd/systemd-journald"] {
        if !Path::new(file).exists() {
            return Err(refuse(
                &format!("{file} does not exist"),
                &install("systemd"),
            ));
        }
    }
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !filesystems
        .lines()
        .any(|l| l.trim_end().ends_with("overlay"))
    {
        return Err(refuse("the kernel has no overlayfs", "modprobe overlay"));
    }
    if cgroup2_root().is_none() {
        return Err(refuse(
            "no cgroup2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified",
            "boot with cgroup v2 (or the hybrid layout)",
        ));
    }
    if !Path::new(STATE_ROOT).is_dir() {
        return Err(refuse(
            &format!("{STATE_ROOT} does not exist (the namespace mounts its tmpfs there)"),
            &format!("mkdir {STATE_ROOT}"),
        ));
    }
    Ok(())
}

fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(INNER_PATH.split(':'))
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(name))
        .find(|candidate| candidate.is_file())
}

/// Where the host's cgroup2 hierarchy is mounted (pure v2, or the hybrid layout's `unified`).
fn cgroup2_root() -> Option<PathBuf> {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .find(|path| {
            let Ok(c_path) = CString::new(*path) else {
                return false;
            };
            // SAFETY: statfs writes into the struct we own (plain data, zeroes are valid); the
            // path is NUL-terminated.
            let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
            let found = unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } == 0;
            found && stat.f_type as i64 == CGROUP2_SUPER_MAGIC
        })
        .map(PathBuf::from)
}

// ---------------------------------------------------------------------------------------------
// The namespace

/// A running private systemd. See the module header.
pub struct Namespace {
    name: String,
    /// PID 1 of the namespace, as this process sees it.
    pid1: u32,
    unshare: Child,
    /// The namespace's cgroup (on the host's cgroup2 hierarchy).
    cgroup: PathBuf,
    /// Host-side files of this namespace: the console log.
    host_dir: PathBuf,
    stopped: bool,
}

impl Namespace {
    /// Boots a manager; panics (one line first) if the machine cannot, or the boot fails.
    pub fn boot(label: &str) -> Namespace {
        if let Err(line) = preflight() {
            panic!("{line}");
        }
        Namespace::try_boot(label).unwrap_or_else(|e| panic!("systemd namespace {label}: {e}"))
    }

    fn try_boot(label: &str) -> Result<Namespace, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "orca-relay-test-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let host_dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&host_dir).map_err(|e| format!("create {host_dir:?}: {e}"))?;
        let cgroup = cgroup2_root().ok_or("no cgroup2 hierarchy")?.join(&name);
        std::fs::create_dir(&cgroup).map_err(|e| format!("create cgroup {cgroup:?}: {e}"))?;

        let pty = Pty::open().map_err(|e| format!("open a pty: {e}"))?;
        let (go_read, go_write) = pipe().map_err(|e| format!("pipe: {e}"))?;
        let mut command = Command::new("unshare");
        command
            .args([
                "--pid",
                "--fork",
                "--kill-child",
                "--mount",
                "--mount-proc",
                "--uts",
                "--ipc",
                "--net",
                "--cgroup",
                "--",
                "/bin/sh",
                "-c",
                INIT_SCRIPT,
                "sh",
            ])
            .args(manager_command())
            .env_clear()
            .env("PATH", INNER_PATH)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child_setup = ChildSetup {
            console: pty.slave.as_raw_fd(),
            go: go_read.as_raw_fd(),
            cgroup_procs: CString::new(
                cgroup
                    .join("cgroup.procs")
                    .into_os_string()
                    .into_encoded_bytes(),
            )
            .map_err(|e| format!("cgroup path: {e}"))?,
        };
        // SAFETY: the closure runs in the child between fork and exec and makes only
        // async-signal-safe calls (setsid, ioctl, dup2, fcntl, open, write, close, prctl) on
        // descriptors and a path prepared before the fork.
        unsafe {
            command.pre_exec(move || child_setup.apply());
        }
        let unshare = command.spawn().map_err(|e| format!("start unshare: {e}"))?;
        drop(go_read);
        let slave_path = pty.slave_path.clone();
        pty.copy_output_to(host_dir.join("console.log"));

        let mut namespace = Namespace {
            name,
            pid1: 0,
            unshare,
            cgroup,
            host_dir,
            stopped: false,
        };
        namespace.pid1 = namespace.wait_for_init()?;
        namespace.prepare_filesystems(&slave_path)?;
        // Go: the shell execs the manager.
        let mut go = File::from(go_write);
        go.write_all(b"go\n")
            .map_err(|e| format!("start the manager: {e}"))?;
        drop(go);
        namespace.wait_for_manager()?;
        Ok(namespace)
    }

    /// The namespace's PID 1 as the host sees it.
    pub fn pid1(&self) -> u32 {
        self.pid1
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The first process of the new namespaces (forked by `unshare`), once it runs the shell.
    fn wait_for_init(&mut self) -> Result<u32, String> {
        let unshare = self.unshare.id();
        let mut found = None;
        let started = wait_until(Duration::from_secs(10), || {
            let children =
                std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children"))
                    .unwrap_or_default();
            found = children
                .split_whitespace()
                .next()
                .and_then(|p| p.parse().ok());
            found.is_some_and(|pid: u32| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|comm| comm.trim() == "sh")
            })
        });
        match found {
            Some(pid) if started => Ok(pid),
            _ => Err(format!(
                "unshare started no namespace; console:\n{}",
                self.console()
            )),
        }
    }

    /// The mounts of the module header, from outside, before the manager starts.
    fn prepare_filesystems(&self, console: &Path) -> Result<(), String> {
        let mount = |args: &[&str]| self.setup(&[&["mount"], args].concat());
        mount(&["--bind", "/proc/sys", "/proc/sys"])?;
        mount(&["-o", "remount,bind,ro", "/proc/sys"])?;
        if Path::new("/proc/sysrq-trigger").exists() {
            mount(&["--bind", "/proc/sysrq-trigger", "/proc/sysrq-trigger"])?;
            mount(&["-o", "remount,bind,ro", "/proc/sysrq-trigger"])?;
        }
        self.setup(&["umount", "--recursive", "--lazy", "/sys/fs/cgroup"])?;
        mount(&["-o", "remount,bind,ro", "/sys"])?;
        // Rooted at the namespace's cgroup: the inner manager owns that subtree.
        mount(&[
            "-t",
            "cgroup2",
            "-o",
            "nosuid,nodev,noexec",
            "cgroup2",
            "/sys/fs/cgroup",
        ])?;

        mount(&[
            "-t",
            "tmpfs",
            "-o",
            "mode=755",
            "orca-relay-test",
            STATE_ROOT,
        ])?;
        for dir in ["units", "empty", "dev", "overlay"] {
            self.create_dir(&format!("{STATE_ROOT}/{dir}"))?;
        }
        for dir in overlaid_directories() {
            let upper = format!("{STATE_ROOT}/overlay/{dir}/upper");
            let work = format!("{STATE_ROOT}/overlay/{dir}/work");
            self.create_dir(&upper)?;
            self.create_dir(&work)?;
            mount(&[
                "-t",
                "overlay",
                "overlay",
                "-o",
                &format!("lowerdir=/{dir},upperdir={upper},workdir={work}"),
                &format!("/{dir}"),
            ])?;
        }
        mount(&[
            "-t",
            "tmpfs",
            "-o",
            "mode=755",
            "orca-relay-test",
            "/etc/systemd/system",
        ])?;
        mount(&[
            "-t",
            "tmpfs",
            "-o",
            "mode=1777,nosuid,nodev",
            "orca-relay-test",
            "/tmp",
        ])?;
        for under_run in self.mounts_under("/run/")? {
            self.setup(&["umount", "--lazy", &under_run])?;
        }
        mount(&[
            "-t",
            "tmpfs",
            "-o",
            "mode=755,nosuid,nodev",
            "orca-relay-test",
            "/run",
        ])?;

        let dev = format!("{STATE_ROOT}/dev");
        mount(&[
            "-t",
            "tmpfs",
            "-o",
            "mode=755,nosuid",
            "orca-relay-test",
            &dev,
        ])?;
        for node in ["null", "zero", "full", "random", "urandom", "tty"] {
            self.write(&format!("{dev}/{node}"), "");
            mount(&["--bind", &format!("/dev/{node}"), &format!("{dev}/{node}")])?;
        }
        self.write(&format!("{dev}/console"), "");
        mount(&[
            "--bind",
            &console.to_string_lossy(),
            &format!("{dev}/console"),
        ])?;
        for dir in ["pts", "shm", "mqueue"] {
            self.create_dir(&format!("{dev}/{dir}"))?;
        }
        mount(&[
            "-t",
            "devpts",
            "-o",
            "newinstance,ptmxmode=0666,mode=620",
            "devpts",
            &format!("{dev}/pts"),
        ])?;
        mount(&[
            "-t",
            "mqueue",
            "-o",
            "nosuid,nodev,noexec",
            "mqueue",
            &format!("{dev}/mqueue"),
        ])?;
        mount(&[
            "-t",
            "tmpfs",
            "-o",
            "mode=1777,nosuid,nodev",
            "orca-relay-test",
            &format!("{dev}/shm"),
        ])?;
        for (link, target) in [
            ("ptmx", "pts/ptmx"),
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ] {
            std::os::unix::fs::symlink(target, self.path(&format!("{dev}/{link}")))
                .map_err(|e| format!("symlink /dev/{link}: {e}"))?;
        }
        mount(&["--move", &dev, "/dev"])?;

        for (name, text) in units::stubs() {
            self.write(&format!("{STATE_ROOT}/units/{name}"), &text);
        }
        for name in units::FROM_SYSTEMD {
            let text = std::fs::read_to_string(Path::new("/lib/systemd/system").join(name))
                .map_err(|e| format!("read the machine's {name}: {e}"))?;
            self.write(&format!("{STATE_ROOT}/units/{name}"), &text);
        }
        Ok(())
    }

    /// Mount points under `prefix` inside, deepest first.
    fn mounts_under(&self, prefix: &str) -> Result<Vec<String>, String> {
        let info = std::fs::read_to_string(format!("/proc/{}/mountinfo", self.pid1))
            .map_err(|e| format!("read mountinfo: {e}"))?;
        let mut points: Vec<String> = info
            .lines()
            .filter_map(|line| line.split(' ').nth(4))
            .filter(|point| point.starts_with(prefix))
            .map(str::to_string)
            .collect();
        points.sort_by_key(|point| std::cmp::Reverse(point.len()));
        Ok(points)
    }

    fn wait_for_manager(&self) -> Result<(), String> {
        let socket = self.path("/run/systemd/private");
        let pid1 = self.pid1;
        let up = wait_until(BOOT_DEADLINE, || {
            socket.exists() || !Path::new(&format!("/proc/{pid1}")).exists()
        });
        if !up || !socket.exists() {
            return Err(format!(
                "the manager did not come up; console:\n{}",
                self.console()
            ));
        }
        let state = self.run(&["systemctl", "is-system-running", "--wait"]);
        let state = String::from_utf8_lossy(&state.stdout).trim().to_string();
        if state != "running" {
            let failed = self.run(&["systemctl", "--failed", "--no-legend"]);
            return Err(format!(
                "the manager is {state:?}, not running; failed units:\n{}\nconsole:\n{}",
                String::from_utf8_lossy(&failed.stdout),
                self.console()
            ));
        }
        Ok(())
    }

    /// One step of [`Namespace::prepare_filesystems`], in every namespace of PID 1: a cgroup2
    /// or mqueue mount shows the mounting process's cgroup or IPC namespace, and the mount
    /// tools read `/proc/self`, which the namespace's `/proc` shows only to its own processes.
    fn setup(&self, args: &[&str]) -> Result<(), String> {
        let output = Command::new("nsenter")
            .arg(format!("--target={}", self.pid1))
            .args([
                "--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup", "--wd=/", "--",
            ])
            .args(args)
            .env_clear()
            .env("PATH", INNER_PATH)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run nsenter: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "`{}` failed inside: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }

    fn create_dir(&self, inside: &str) -> Result<(), String> {
        std::fs::create_dir_all(self.path(inside)).map_err(|e| format!("mkdir {inside}: {e}"))
    }

    /// The console (the manager's own messages), for failure reports.
    pub fn console(&self) -> String {
        std::fs::read_to_string(self.host_dir.join("console.log")).unwrap_or_default()
    }

    // -----------------------------------------------------------------------------------------
    // Running things inside

    /// `args` as a command inside every namespace (pid included: `kill` takes inner pids),
    /// with a clean environment, `/` as working directory and a deadline.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new("timeout");
        command
            .args([
                "--kill-after=5",
                &COMMAND_DEADLINE.as_secs().to_string(),
                "nsenter",
                &format!("--target={}", self.pid1),
                "--mount",
                "--uts",
                "--ipc",
                "--net",
                "--pid",
                "--cgroup",
                "--wd=/",
                "--",
            ])
            .args(args)
            .env_clear()
            .env("PATH", INNER_PATH)
            .env("LC_ALL", "C.UTF-8")
            .env("SYSTEMD_PAGER", "")
            .env("SYSTEMD_COLORS", "0")
            .stdin(Stdio::null());
        command
    }

    /// Runs `args` inside to its end.
    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args)
            .output()
            .unwrap_or_else(|e| panic!("run {args:?} in {}: {e}", self.name))
    }

    /// Runs `args` inside; its stdout, or a panic with its stderr if it fails.
    pub fn run_ok(&self, args: &[&str]) -> String {
        let output = self.run(args);
        assert!(
            output.status.success(),
            "`{}` failed in {} ({}):\n{}{}",
            args.join(" "),
            self.name,
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// `systemctl ARGS` inside (no pager); the whole output.
    pub fn systemctl(&self, args: &[&str]) -> Output {
        self.run(&[&["systemctl", "--no-pager"], args].concat())
    }

    pub fn systemctl_ok(&self, args: &[&str]) -> String {
        self.run_ok(&[&["systemctl", "--no-pager"], args].concat())
    }

    /// One property of a unit (`systemctl show -p NAME --value`).
    pub fn show(&self, unit: &str, property: &str) -> String {
        self.systemctl_ok(&["show", "-p", property, "--value", unit])
            .trim()
            .to_string()
    }

    /// The unit's `MainPID` inside the namespace (0 when it has none).
    pub fn main_pid(&self, unit: &str) -> u32 {
        self.show(unit, "MainPID").parse().unwrap_or(0)
    }

    /// Links a unit file (an installed one, say) into `/etc/systemd/system`, the search path
    /// an operator's units live in, and reloads: `systemctl link`.
    pub fn link_unit(&self, path: &str) {
        self.systemctl_ok(&["link", path]);
        self.systemctl_ok(&["daemon-reload"]);
    }

    /// Adds a unit of the test's own (a database, say) to the search path and reloads.
    pub fn add_unit(&self, name: &str, text: &str) {
        self.write(&format!("{STATE_ROOT}/units/{name}"), text);
        self.systemctl_ok(&["daemon-reload"]);
    }

    /// The unit's journal: its own lines and the manager's lines about it.
    pub fn journal(&self, unit: &str) -> Vec<Entry> {
        journal::parse(&self.run_ok(&[
            "journalctl",
            "--no-pager",
            "--output=json",
            &format!("--unit={unit}"),
        ]))
    }

    /// The unit's journal as `journalctl -o cat` prints it, for failure messages.
    pub fn journal_text(&self, unit: &str) -> String {
        journal::render(&self.journal(unit))
    }

    /// Waits until an entry of the unit's journal satisfies `matches`; returns it, or panics
    /// with the journal after `timeout`.
    pub fn wait_for_entry(
        &self,
        unit: &str,
        timeout: Duration,
        matches: impl Fn(&Entry) -> bool,
    ) -> Entry {
        let mut found = None;
        wait_until(timeout, || {
            found = self.journal(unit).into_iter().find(|entry| matches(entry));
            found.is_some()
        });
        found.unwrap_or_else(|| {
            panic!(
                "{unit}: no such journal entry within {timeout:?}; journal:\n{}",
                self.journal_text(unit)
            )
        })
    }

    /// Waits until `systemctl show -p ActiveState,SubState` says `state` (`active/running`,
    /// `inactive/dead`, …); panics with the journal after `timeout`.
    pub fn wait_for_state(&self, unit: &str, state: &str, timeout: Duration) {
        let mut last = String::new();
        let reached = wait_until(timeout, || {
            last = format!(
                "{}/{}",
                self.show(unit, "ActiveState"),
                self.show(unit, "SubState")
            );
            last == state
        });
        assert!(
            reached,
            "{unit} is {last}, not {state}, after {timeout:?}; journal:\n{}",
            self.journal_text(unit)
        );
    }

    // -----------------------------------------------------------------------------------------
    // Files inside

    /// A path inside the namespace, as this process reaches it (`/proc/<pid 1>/root/…`).
    pub fn path(&self, inside: &str) -> PathBuf {
        Path::new(&format!("/proc/{}/root", self.pid1)).join(inside.trim_start_matches('/'))
    }

    pub fn read(&self, inside: &str) -> String {
        std::fs::read_to_string(self.path(inside))
            .unwrap_or_else(|e| panic!("read {inside} in {}: {e}", self.name))
    }

    /// Writes a file inside (an existing file keeps its owner and mode).
    pub fn write(&self, inside: &str, text: &str) {
        std::fs::write(self.path(inside), text)
            .unwrap_or_else(|e| panic!("write {inside} in {}: {e}", self.name))
    }

    /// Sets variables of an env file in place, as an operator fills one in: each `NAME=` line
    /// gets the new value; comments and every other line stay. Each name must be in the file.
    pub fn set_env_values(&self, inside: &str, values: &[(&str, &str)]) {
        let text = self.read(inside);
        let mut found = vec![0; values.len()];
        let lines: Vec<String> = text
            .lines()
            .map(|line| {
                let name = line.split_once('=').map(|(name, _)| name.trim());
                match values
                    .iter()
                    .position(|(wanted, _)| !line.starts_with('#') && name == Some(*wanted))
                {
                    Some(index) => {
                        found[index] += 1;
                        format!("{}={}", values[index].0, values[index].1)
                    }
                    None => line.to_string(),
                }
            })
            .collect();
        for ((name, _), count) in values.iter().zip(&found) {
            assert_eq!(*count, 1, "{inside}: {name}= is in the file {count} times");
        }
        self.write(inside, &(lines.join("\n") + "\n"));
    }

    /// Installs a `.deb` with `dpkg -i` inside (maintainer scripts included); dpkg's output.
    pub fn install_deb(&self, deb: &Path) -> String {
        let inside = format!("{STATE_ROOT}/orca-relay.deb");
        std::fs::copy(deb, self.path(&inside))
            .unwrap_or_else(|e| panic!("copy {deb:?} into {}: {e}", self.name));
        self.run_ok(&["dpkg", "--install", &inside])
    }

    // -----------------------------------------------------------------------------------------
    // The network inside

    /// Runs `what` on a thread that joined the namespace's network namespace: sockets it
    /// opens belong to that network and keep working from any thread.
    pub fn in_network<T: Send>(&self, what: impl FnOnce() -> T + Send) -> T {
        let netns = File::open(format!("/proc/{}/ns/net", self.pid1))
            .unwrap_or_else(|e| panic!("open the network namespace of {}: {e}", self.name));
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("test-netns".into())
                .spawn_scoped(scope, move || {
                    // SAFETY: setns changes only this thread's network namespace, to the one
                    // the open descriptor names.
                    let joined = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
                    assert_eq!(
                        joined,
                        0,
                        "join the network namespace: {}",
                        io::Error::last_os_error()
                    );
                    what()
                })
                .expect("spawn a thread")
                .join()
                .expect("the network thread panicked")
        })
    }

    /// A TCP connection to `addr` inside the namespace.
    pub fn connect(&self, addr: &str) -> TcpStream {
        let addr: SocketAddr = addr.parse().expect("a socket address");
        self.in_network(|| TcpStream::connect_timeout(&addr, Duration::from_secs(10)))
            .unwrap_or_else(|e| panic!("connect to {addr} in {}: {e}", self.name))
    }

    /// A listener inside the namespace (`127.0.0.1:0` picks a free port).
    pub fn listen(&self, addr: &str) -> TcpListener {
        self.in_network(|| TcpListener::bind(addr))
            .unwrap_or_else(|e| panic!("listen on {addr} in {}: {e}", self.name))
    }

    /// One HTTP/1.1 request to a listener inside: (status, body).
    pub fn http(
        &self,
        method: &str,
        addr: &str,
        path: &str,
        bearer: Option<&str>,
        body: &str,
    ) -> (u16, String) {
        let mut stream = self.connect(addr);
        stream
            .set_read_timeout(Some(Duration::from_secs(15)))
            .expect("read timeout");
        let authorization = bearer
            .map(|token| format!("Authorization: Bearer {token}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{authorization}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).expect("send");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).expect("read the answer");
        let answer = String::from_utf8_lossy(&answer);
        let status = answer
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP answer from {addr}{path}: {answer:?}"));
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_string())
            .unwrap_or_default();
        (status, body)
    }

    // -----------------------------------------------------------------------------------------
    // The end

    /// Ends the namespace: PID 1 is killed (the kernel kills the rest of its pid namespace),
    /// then the cgroup is emptied and removed. Idempotent; `Drop` calls it.
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        // Only while it is still unshare's child: a PID 1 that ended on its own was reaped by
        // unshare, and its pid may belong to another process by now.
        let unshare = self.unshare.id();
        let children = std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children"))
            .unwrap_or_default();
        if self.pid1 != 0
            && children
                .split_whitespace()
                .any(|p| p == self.pid1.to_string())
        {
            // SAFETY: kill has no memory-safety preconditions; the pid is our namespace's init.
            unsafe { libc::kill(self.pid1 as libc::pid_t, libc::SIGKILL) };
        }
        if !wait_until(Duration::from_secs(10), || {
            matches!(self.unshare.try_wait(), Ok(Some(_)))
        }) {
            let _ = self.unshare.kill();
        }
        let _ = self.unshare.wait();
        let events = self.cgroup.join("cgroup.events");
        let empty = || {
            std::fs::read_to_string(&events)
                .map(|text| text.contains("populated 0"))
                .unwrap_or(true)
        };
        if !wait_until(Duration::from_secs(10), empty) {
            let _ = std::fs::write(self.cgroup.join("cgroup.kill"), "1");
            wait_until(Duration::from_secs(10), empty);
        }
        remove_cgroup(&self.cgroup);
        let _ = std::fs::remove_dir_all(&self.host_dir);
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The top-level directories that get an overlay: `/etc`, `/usr`, `/var`, and those of `/lib`,
/// `/lib64`, `/bin`, `/sbin` that are directories of their own (not links into `/usr`).
fn overlaid_directories() -> Vec<&'static str> {
    let mut dirs = vec!["etc", "usr", "var"];
    for dir in ["lib", "lib64", "bin", "sbin"] {
        let metadata = std::fs::symlink_metadata(format!("/{dir}"));
        if metadata.is_ok_and(|m| m.is_dir()) {
            dirs.push(dir);
        }
    }
    dirs
}

/// The manager's command line: a clean environment that points it at the test's units only.
fn manager_command() -> Vec<String> {
    let target = units::DEFAULT_TARGET;
    [
        "env",
        "-i",
        "container=orca-relay-test",
        &format!("SYSTEMD_UNIT_PATH={STATE_ROOT}/units:/etc/systemd/system"),
        &format!("SYSTEMD_GENERATOR_PATH={STATE_ROOT}/empty"),
        &format!("SYSTEMD_ENVIRONMENT_GENERATOR_PATH={STATE_ROOT}/empty"),
        "SYSTEMD_LOG_LEVEL=info",
        "SYSTEMD_LOG_TARGET=journal-or-kmsg",
        "SYSTEMD_LOG_COLOR=0",
        &format!("PATH={INNER_PATH}"),
        "setpriv",
        "--bounding-set=-sys_boot,-sys_module",
        SYSTEMD,
        "--system",
        &format!("--unit={target}"),
        "--show-status=no",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Removes a cgroup directory and the ones the inner manager created under it, deepest first.
fn remove_cgroup(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&entry.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Polls `condition` every 50 ms until it holds or `timeout` passes; whether it held.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = orca_relay::clock::instant() + timeout;
    loop {
        if condition() {
            return true;
        }
        if orca_relay::clock::instant() >= deadline {
            return false;
        }
        orca_relay::clock::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------------------------
// The child's setup, the pty and the go pipe

/// What `unshare` gets between fork and exec.
struct ChildSetup {
    /// The pty's slave: the controlling terminal and stdin, stdout, stderr.
    console: i32,
    /// The go pipe's read end, passed on as descriptor 3.
    go: i32,
    /// `<cgroup>/cgroup.procs`: the child moves itself into the namespace's cgroup.
    cgroup_procs: CString,
}

impl ChildSetup {
    /// Runs in the forked child: only async-signal-safe calls.
    fn apply(&self) -> io::Result<()> {
        let check = |result: libc::c_int| {
            if result < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(result)
            }
        };
        // SAFETY: plain system calls on descriptors this process owns and a NUL-terminated
        // path; no allocation, no locks.
        unsafe {
            check(libc::setsid())?;
            check(libc::ioctl(self.console, libc::TIOCSCTTY, 0))?;
            for target in 0..3 {
                check(libc::dup2(self.console, target))?;
            }
            if self.go == 3 {
                check(libc::fcntl(3, libc::F_SETFD, 0))?;
            } else {
                check(libc::dup2(self.go, 3))?;
            }
            let procs = check(libc::open(
                self.cgroup_procs.as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            ))?;
            let written = libc::write(procs, b"0".as_ptr().cast(), 1);
            libc::close(procs);
            if written != 1 {
                return Err(io::Error::last_os_error());
            }
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL))?;
        }
        Ok(())
    }
}

/// A pseudo-terminal whose slave becomes the namespace's console.
struct Pty {
    master: OwnedFd,
    slave: OwnedFd,
    slave_path: PathBuf,
}

impl Pty {
    fn open() -> io::Result<Pty> {
        let (mut master, mut slave) = (-1, -1);
        // SAFETY: openpty writes two new descriptors into the integers we pass; the name,
        // termios and window-size arguments may be null.
        let opened = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if opened != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors are new and ours alone.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        for fd in [&master, &slave] {
            // SAFETY: fcntl on a descriptor we own; only the close-on-exec flag changes.
            if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // Raw: the console log holds what the manager wrote, no echo or line discipline.
        // SAFETY: termios is plain data; tcgetattr fills it, cfmakeraw edits it in place.
        unsafe {
            let mut termios: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(slave.as_raw_fd(), &mut termios) == 0 {
                libc::cfmakeraw(&mut termios);
                libc::tcsetattr(slave.as_raw_fd(), libc::TCSANOW, &termios);
            }
        }
        let slave_path = std::fs::read_link(format!("/proc/self/fd/{}", slave.as_raw_fd()))?;
        Ok(Pty {
            master,
            slave,
            slave_path,
        })
    }

    /// Closes this process's slave (the child has its copies) and copies everything written
    /// to the console into `log` on a detached thread, which ends when the namespace's last
    /// holder of the console is gone.
    fn copy_output_to(self, log: PathBuf) {
        drop(self.slave);
        let mut master = File::from(self.master);
        let copy = move || {
            let Ok(mut file) = File::create(&log) else {
                return;
            };
            let mut buffer = [0u8; 8192];
            while let Ok(read) = master.read(&mut buffer) {
                if read == 0 || file.write_all(&buffer[..read]).is_err() {
                    return;
                }
            }
        };
        std::thread::Builder::new()
            .name("test-console".into())
            .spawn(copy)
            .expect("spawn the console copier");
    }
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1; 2];
    // SAFETY: pipe2 writes two new descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both are new and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
