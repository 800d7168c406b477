//! The nemesis's own PostgreSQL: a throwaway server it may stop, crash, cut off and slow down
//! without disturbing any other test's database.
//!
//! - **Restarts**: `pg_ctl stop -m fast` (sessions cut, clean shutdown) or `-m immediate` (a
//!   crash: recovery at the next start), then `pg_ctl start` on the same data and port.
//! - **Unreachable**: as root, the server runs in a network namespace of its own, reached over a
//!   veth pair; cutting it off sets the namespace's end of the link down. Packets are then
//!   dropped silently, exactly like a partition: a connect times out, a statement in flight
//!   waits until the client's TCP user timeout. Without root (no namespaces), a TCP proxy sits
//!   between the fleet and the server and stops forwarding; that is less faithful (the proxy's
//!   kernel still acknowledges what the fleet sends, so a client's TCP user timeout never
//!   fires and a statement in flight waits until the link heals), which is why the namespace
//!   is preferred.
//! - **Slow**: as root with the cgroup v1 `cpu` controller mounted, every server process runs in
//!   a cgroup of its own whose CPU quota the nemesis lowers (a brownout); without it the kind is
//!   not available.
//!
//! The checkers connect over the server's Unix socket (in its data directory), which no cut
//! affects: they read the database's own view while the fleet cannot reach it.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `max_connections` of the server (the fleet file's `max_connections`).
pub const MAX_CONNECTIONS: u64 = 60;
/// `superuser_reserved_connections` (PostgreSQL's default): the fleet file's `reserve`.
pub const SUPERUSER_RESERVED: u64 = 3;

/// How the fleet reaches the server, and how it is cut off.
enum Net {
    Namespace {
        name: String,
        ns_if: String,
        ns_ip: String,
    },
    Proxy(Proxy),
}

pub struct Postgres {
    bindir: PathBuf,
    data: PathBuf,
    port: u16,
    /// The OS user the server runs as (root: `postgres`); `None`: this user.
    user: Option<String>,
    net: Net,
    cgroup: Option<PathBuf>,
    /// Why the stronger mechanisms were not used, for the history.
    pub notes: Vec<String>,
}

fn root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn bindir() -> PathBuf {
    if let Some(pg_ctl) = std::env::var_os("ORCA_RELAY_TEST_PG_CTL") {
        if let Some(dir) = Path::new(&pg_ctl).parent() {
            return dir.to_path_buf();
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|entry| entry.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!(
            "the nemesis needs PostgreSQL's initdb and pg_ctl (scripts/test-postgres.sh start \
             installs postgresql-15)"
        )
    })
}

/// Runs `program args…`; panics with its output when it fails.
fn run(program: &str, args: &[&str]) {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {program} {args:?}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn try_run(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

const NETNS_PREFIX: &str = "orca-nem-";
const CGROUP_CPU: &str = "/sys/fs/cgroup/cpu";

/// Removes namespaces and cgroups left by nemesis runs whose process is gone (a run killed
/// with `kill -9` cannot clean up after itself).
fn remove_leftovers() {
    if let Ok(output) = Command::new("ip").args(["netns", "list"]).output() {
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or_default();
            if let Some(pid) = name.strip_prefix(NETNS_PREFIX) {
                if pid.parse::<u32>().is_ok_and(|pid| !pid_alive(pid)) {
                    try_run("ip", &["netns", "delete", name]);
                }
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(CGROUP_CPU) {
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().to_string();
            if let Some(pid) = name.strip_prefix(NETNS_PREFIX) {
                if pid.parse::<u32>().is_ok_and(|pid| !pid_alive(pid)) {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
        }
    }
}

impl Postgres {
    /// A new server: `initdb`, its network, its cgroup, started.
    pub fn start_new() -> Postgres {
        let bindir = bindir();
        let user = root().then(|| "postgres".to_string());
        static N: AtomicU32 = AtomicU32::new(0);
        let data = std::env::temp_dir().join(format!(
            "orca-nemesis-pg-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&data);
        std::fs::create_dir_all(&data).expect("create the nemesis PostgreSQL data directory");
        if let Some(user) = &user {
            run("chown", &[&format!("{user}:"), &data.display().to_string()]);
        }
        run("chmod", &["700", &data.display().to_string()]);
        let mut notes = Vec::new();
        let mut initdb = Command::new(bindir.join("initdb"));
        initdb.args(["-D", &data.display().to_string()]);
        initdb.args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
        ]);
        let output = as_user(&user, initdb)
            .stdin(Stdio::null())
            .output()
            .expect("run initdb");
        assert!(
            output.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        remove_leftovers();
        let port = free_port();
        let forced_proxy = std::env::var("ORCA_RELAY_NEMESIS_NET").is_ok_and(|v| v == "proxy");
        let namespace = if root() && !forced_proxy {
            match make_namespace() {
                Ok(net) => Some(net),
                Err(e) => {
                    notes.push(format!("network_namespace=unavailable reason={e:?}"));
                    None
                }
            }
        } else {
            notes.push(format!(
                "network_namespace=unavailable reason={}",
                if forced_proxy {
                    "ORCA_RELAY_NEMESIS_NET=proxy"
                } else {
                    "not_root"
                }
            ));
            None
        };
        let listen = match &namespace {
            Some(Net::Namespace { ns_ip, .. }) => ns_ip.clone(),
            _ => "127.0.0.1".to_string(),
        };
        let conf = format!(
            "listen_addresses = '{listen}'\nport = {port}\nunix_socket_directories = '{}'\n\
             max_connections = {MAX_CONNECTIONS}\nsuperuser_reserved_connections = {SUPERUSER_RESERVED}\n\
             shared_buffers = 32MB\nfsync = off\nsynchronous_commit = off\nfull_page_writes = off\n\
             logging_collector = on\nlog_directory = 'log'\nlog_filename = 'postgresql.log'\n",
            data.display()
        );
        let conf_path = data.join("postgresql.conf");
        let mut existing = std::fs::read_to_string(&conf_path).expect("read postgresql.conf");
        existing.push_str(&conf);
        std::fs::write(&conf_path, existing).expect("write postgresql.conf");
        // initdb trusts loopback only; the fleet comes from the host end of the veth pair.
        let hba_path = data.join("pg_hba.conf");
        let mut hba = std::fs::read_to_string(&hba_path).expect("read pg_hba.conf");
        hba.push_str("host all all 10.0.0.0/8 trust\n");
        std::fs::write(&hba_path, hba).expect("write pg_hba.conf");
        std::fs::create_dir_all(data.join("log")).expect("create the log directory");
        if let Some(user) = &user {
            run(
                "chown",
                &["-R", &format!("{user}:"), &data.display().to_string()],
            );
        }
        let net = match namespace {
            Some(net) => net,
            None => Net::Proxy(Proxy::start(SocketAddr::from(([127, 0, 0, 1], port)))),
        };
        let cgroup = if root() {
            match make_cgroup() {
                Ok(path) => Some(path),
                Err(e) => {
                    notes.push(format!("cpu_cgroup=unavailable reason={e:?}"));
                    None
                }
            }
        } else {
            notes.push("cpu_cgroup=unavailable reason=not_root".into());
            None
        };
        let postgres = Postgres {
            bindir,
            data,
            port,
            user,
            net,
            cgroup,
            notes,
        };
        postgres.start();
        postgres
    }

    /// Whether the fault kinds that need the cgroup can run.
    pub fn can_slow_down(&self) -> bool {
        self.cgroup.is_some()
    }

    /// How the fleet is cut off: `namespace` or `proxy`.
    pub fn cut_mechanism(&self) -> &'static str {
        match self.net {
            Net::Namespace { .. } => "namespace",
            Net::Proxy(_) => "proxy",
        }
    }

    /// The URL the fleet uses for `database`.
    pub fn fleet_url(&self, database: &str) -> String {
        match &self.net {
            Net::Namespace { ns_ip, .. } => {
                format!("postgres://postgres@{ns_ip}:{}/{database}", self.port)
            }
            Net::Proxy(proxy) => format!(
                "postgres://postgres@127.0.0.1:{}/{database}",
                proxy.listen.port()
            ),
        }
    }

    /// The address the fleet's connections go to (for reading their client sockets).
    pub fn fleet_addr(&self) -> SocketAddr {
        match &self.net {
            Net::Namespace { ns_ip, .. } => {
                SocketAddr::new(ns_ip.parse().expect("namespace ip"), self.port)
            }
            Net::Proxy(proxy) => proxy.listen,
        }
    }

    /// A connection over the Unix socket (no cut affects it); `None` while the server is down.
    pub fn admin(&self, database: &str) -> Option<postgres::Client> {
        postgres::Config::new()
            .host_path(&self.data)
            .port(self.port)
            .user("postgres")
            .dbname(database)
            .application_name("orca-relay-nemesis")
            .connect_timeout(Duration::from_secs(3))
            .connect(postgres::NoTls)
            .ok()
    }

    /// A new, empty database.
    pub fn create_database(&self, name: &str) {
        let mut admin = self
            .admin("postgres")
            .expect("connect to the nemesis PostgreSQL");
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\""))
            .expect("drop database");
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .expect("create database");
    }

    fn pg_ctl(&self, args: &[&str], in_namespace: bool) -> bool {
        let pg_ctl = self.bindir.join("pg_ctl");
        let mut command = match (&self.net, in_namespace) {
            (Net::Namespace { name, .. }, true) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", name]);
                if let Some(user) = &self.user {
                    c.args(["runuser", "-u", user, "--"]);
                }
                c.arg(&pg_ctl);
                c
            }
            _ => as_user(&self.user, Command::new(&pg_ctl)),
        };
        command
            .args(["-D", &self.data.display().to_string()])
            .args(args);
        if let Some(cgroup) = &self.cgroup {
            // The server is started from inside its cgroup, so that every process it forks is
            // throttled with it.
            let procs = std::ffi::CString::new(cgroup.join("cgroup.procs").display().to_string())
                .expect("a cgroup path without NUL");
            // SAFETY: the closure runs in the child between fork and exec and only calls
            // open, write and close (async-signal-safe) on a path made before the fork.
            unsafe {
                command.pre_exec(move || {
                    let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // "0": the writing process itself.
                    let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if written != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        // The server keeps its starter's stdout open: never pipe it.
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts the server; waits until it accepts connections.
    pub fn start(&self) {
        let log = self.data.join("log").join("pg_ctl.log");
        let log = log.display().to_string();
        assert!(
            self.pg_ctl(&["-l", &log, "-w", "-t", "120", "start"], true),
            "pg_ctl start failed; see {log}"
        );
    }

    /// Stops the server with `mode` (`fast` or `immediate`).
    pub fn stop(&self, mode: &str) {
        assert!(
            self.pg_ctl(&["-m", mode, "-w", "-t", "120", "stop"], false),
            "pg_ctl stop -m {mode} failed"
        );
    }

    /// Cuts the fleet off (`false`) or reconnects it (`true`).
    pub fn set_reachable(&self, reachable: bool) {
        match &self.net {
            Net::Namespace { name, ns_if, .. } => run(
                "ip",
                &[
                    "netns",
                    "exec",
                    name,
                    "ip",
                    "link",
                    "set",
                    ns_if,
                    if reachable { "up" } else { "down" },
                ],
            ),
            Net::Proxy(proxy) => proxy.cut.store(!reachable, Ordering::SeqCst),
        }
    }

    /// Limits the server to `percent` of one CPU, or lifts the limit (`None`).
    pub fn set_cpu_limit(&self, percent: Option<u32>) {
        let Some(cgroup) = &self.cgroup else { return };
        let quota = percent.map_or(-1, |p| i64::from(p.max(1)) * 1_000);
        std::fs::write(cgroup.join("cpu.cfs_quota_us"), quota.to_string())
            .expect("write the CPU quota");
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.set_cpu_limit(None);
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "-t", "60", "stop"], false);
        if let Net::Namespace { name, .. } = &self.net {
            try_run("ip", &["netns", "delete", name]);
        }
        if let Some(cgroup) = &self.cgroup {
            let _ = std::fs::remove_dir(cgroup);
        }
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

fn as_user(user: &Option<String>, command: Command) -> Command {
    match user {
        Some(user) => {
            let mut c = Command::new("runuser");
            c.args(["-u", user, "--"]).arg(command.get_program());
            c.args(command.get_args());
            c
        }
        None => command,
    }
}

/// A free port below the kernel's ephemeral range, so that no outgoing connection of any
/// process can be holding it when a process restarts on it.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = 20_000 + (std::process::id() % 500) * 20;
    for _ in 0..2_000 {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let port = 20_000 + (base + n * 7) % 12_000;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    panic!("no free port below the ephemeral range");
}

fn make_namespace() -> Result<Net, String> {
    let pid = std::process::id();
    let name = format!("{NETNS_PREFIX}{pid}");
    let host_if = format!("onm{pid}h");
    let ns_if = format!("onm{pid}n");
    let (b, c, d) = (100 + (pid >> 14) % 100, (pid >> 6) % 256, (pid % 64) * 4);
    let host_ip = format!("10.{b}.{c}.{}", d + 1);
    let ns_ip = format!("10.{b}.{c}.{}", d + 2);
    let steps: Vec<Vec<String>> = vec![
        vec!["netns".into(), "add".into(), name.clone()],
        vec![
            "link".into(),
            "add".into(),
            host_if.clone(),
            "type".into(),
            "veth".into(),
            "peer".into(),
            "name".into(),
            ns_if.clone(),
        ],
        vec![
            "link".into(),
            "set".into(),
            ns_if.clone(),
            "netns".into(),
            name.clone(),
        ],
        vec![
            "addr".into(),
            "add".into(),
            format!("{host_ip}/30"),
            "dev".into(),
            host_if.clone(),
        ],
        vec!["link".into(), "set".into(), host_if.clone(), "up".into()],
        ns_step(
            &name,
            &["addr", "add", &format!("{ns_ip}/30"), "dev", &ns_if],
        ),
        ns_step(&name, &["link", "set", &ns_if, "up"]),
        ns_step(&name, &["link", "set", "lo", "up"]),
    ];
    for step in &steps {
        let args: Vec<&str> = step.iter().map(String::as_str).collect();
        let output = Command::new("ip")
            .args(&args)
            .output()
            .map_err(|e| e.to_string())?;
        if !output.status.success() {
            try_run("ip", &["link", "delete", &host_if]);
            try_run("ip", &["netns", "delete", &name]);
            return Err(format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
    }
    Ok(Net::Namespace { name, ns_if, ns_ip })
}

fn ns_step(name: &str, args: &[&str]) -> Vec<String> {
    let mut step: Vec<String> = vec!["netns".into(), "exec".into(), name.into(), "ip".into()];
    step.extend(args.iter().map(|a| a.to_string()));
    step
}

fn make_cgroup() -> Result<PathBuf, String> {
    let path = Path::new(CGROUP_CPU).join(format!("{NETNS_PREFIX}{}", std::process::id()));
    std::fs::create_dir_all(&path).map_err(|e| e.to_string())?;
    std::fs::write(path.join("cpu.cfs_period_us"), "100000").map_err(|e| e.to_string())?;
    std::fs::write(path.join("cpu.cfs_quota_us"), "-1").map_err(|e| e.to_string())?;
    Ok(path)
}

/// The TCP proxy of the unprivileged fallback: forwards while `cut` is false; while it is
/// true it forwards nothing and holds new connections unconnected.
struct Proxy {
    listen: SocketAddr,
    cut: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let listen = listener.local_addr().expect("proxy address");
        let cut = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (cut_flag, stop_flag) = (cut.clone(), stop.clone());
        orca_relay::threads::spawn("nemesis-proxy", move || {
            for client in listener.incoming() {
                if stop_flag.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let (cut, stop) = (cut_flag.clone(), stop_flag.clone());
                let _ = orca_relay::threads::spawn("nemesis-proxy-conn", move || {
                    while cut.load(Ordering::SeqCst) && !stop.load(Ordering::SeqCst) {
                        orca_relay::clock::sleep(Duration::from_millis(20));
                    }
                    let Ok(server) = TcpStream::connect(upstream) else {
                        return;
                    };
                    let (c2, s2) = match (client.try_clone(), server.try_clone()) {
                        (Ok(c), Ok(s)) => (c, s),
                        _ => return,
                    };
                    let (cut2, stop2) = (cut.clone(), stop.clone());
                    let _ = orca_relay::threads::spawn("nemesis-proxy-up", move || {
                        forward(c2, s2, &cut2, &stop2)
                    });
                    forward(server, client, &cut, &stop);
                });
            }
        })
        .expect("spawn the proxy");
        Proxy { listen, cut, stop }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.listen);
    }
}

/// Copies `from` to `to` until either side closes; while `cut`, reads nothing.
fn forward(mut from: TcpStream, mut to: TcpStream, cut: &AtomicBool, stop: &AtomicBool) {
    use std::io::{Read, Write};
    let _ = from.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = [0u8; 16 * 1024];
    loop {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        if cut.load(Ordering::SeqCst) {
            orca_relay::clock::sleep(Duration::from_millis(20));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
