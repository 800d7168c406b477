//! Black-box harness: starts the real `orca-relay` binary on free ports and talks to it over
//! real sockets with a real WebSocket client.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

pub mod flood;
pub mod manager;
pub mod proxy;
pub mod raw_http;

use tungstenite::client::IntoClientRequest;
use tungstenite::{Message, WebSocket};

pub type Ws = WebSocket<Stream>;

/// The test clients' TCP stream: a read or write that a signal interrupted is tried again.
/// A process that is stopped and continued (a paused VM, a debugger, another test's SIGSTOP and
/// SIGCONT sent to a pid this process's thread has since taken) sees `EINTR` from socket calls
/// with a timeout, and tungstenite reports it as a failed read: an interrupted call is never a
/// peer that left.
#[derive(Debug)]
pub struct Stream(pub TcpStream);

/// The socket calls other than read and write (timeouts, `shutdown`, `try_clone`).
impl std::ops::Deref for Stream {
    type Target = TcpStream;

    fn deref(&self) -> &TcpStream {
        &self.0
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match self.0.read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                result => return result,
            }
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        loop {
            match self.0.write(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                result => return result,
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Opens a WebSocket over `stream` (the upgrade request is `request`), reads and writes
/// through [`Stream`].
pub fn ws_client(
    request: tungstenite::handshake::client::Request,
    stream: TcpStream,
) -> Result<Ws, tungstenite::Error> {
    match tungstenite::client(request, Stream(stream)) {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::HandshakeError::Failure(e)) => Err(e),
        Err(tungstenite::HandshakeError::Interrupted(_)) => Err(tungstenite::Error::Io(
            std::io::ErrorKind::WouldBlock.into(),
        )),
    }
}

/// The TCP connection for `request`'s `host:port`.
fn tcp_for(request: &tungstenite::handshake::client::Request) -> std::io::Result<TcpStream> {
    let uri = request.uri();
    let host = uri.host().unwrap_or_default();
    let port = uri.port_u16().unwrap_or(80);
    let tcp = TcpStream::connect((host, port))?;
    // As tungstenite's own `connect` does: a small frame goes out at once.
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

/// The self-hosted HS256 key every combined test relay uses.
pub const TEST_KEY: &str = "test-self-hosted-key-0123456789abcdefghijklmnop";

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "orca-relay-{prefix}-{}-{n}-{}",
            std::process::id(),
            orca_relay::clock::system().now_ms()
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a child process wrote to one pipe, line by line, as a reader thread drains it.
/// `drained` turns true once the pipe reached its end (the process and every descendant that
/// held it closed it): only then is the text complete. Every helper that waits for a process's
/// exit also waits for this, so a test never reads a log the last lines of which are still in
/// the pipe (a loaded machine can run the exiting child long before the reader thread).
#[derive(Default)]
pub struct ProcessLog {
    state: Mutex<LogState>,
    changed: Condvar,
}

#[derive(Default)]
struct LogState {
    lines: Vec<String>,
    drained: bool,
}

impl ProcessLog {
    /// Starts a thread that reads `pipe` to its end into a new log (echoed to the test's
    /// stderr as `[label] line` when `ORCA_RELAY_TEST_ECHO` is set).
    pub fn capture(pipe: impl std::io::Read + Send + 'static, label: &str) -> Arc<ProcessLog> {
        let log: Arc<ProcessLog> = Arc::default();
        let sink = log.clone();
        let label = label.to_string();
        std::thread::Builder::new()
            .name(format!("{label}-log"))
            .spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    if std::env::var_os("ORCA_RELAY_TEST_ECHO").is_some() {
                        eprintln!("[{label}] {line}");
                    }
                    sink.lock().lines.push(line);
                    sink.changed.notify_all();
                }
                sink.lock().drained = true;
                sink.changed.notify_all();
            })
            .expect("log thread");
        log
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a line containing `needle`; returns it. Gives up early once the pipe is
    /// drained without one (the process is gone: no such line can still come).
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = orca_relay::clock::instant() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(line) = state.lines.iter().find(|l| l.contains(needle)) {
                return Some(line.clone());
            }
            let now = orca_relay::clock::instant();
            if now >= deadline || state.drained {
                return None;
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits until the pipe has been read to its end; false if `timeout` passed first.
    pub fn wait_drained(&self, timeout: Duration) -> bool {
        let deadline = orca_relay::clock::instant() + timeout;
        let mut state = self.lock();
        loop {
            if state.drained {
                return true;
            }
            let now = orca_relay::clock::instant();
            if now >= deadline {
                return false;
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub fn count(&self, needle: &str) -> usize {
        self.lock()
            .lines
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    pub fn text(&self) -> String {
        self.lock().lines.join("\n")
    }
}

/// How long a process's output may take to be drained once the process has exited: the
/// reader thread only has to be scheduled, but on a loaded machine that can take a while.
pub const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(30);

/// Waits up to `timeout` for `child` to exit, then for `outputs` to be drained; returns the
/// exit code (-1 for a signal), or `None` if it did not exit in time. Panics if the output is
/// not drained within [`DRAIN_AFTER_EXIT`] of the exit (a descendant holding the pipe).
pub fn wait_exit_drained(
    child: &mut Child,
    outputs: &[&ProcessLog],
    timeout: Duration,
) -> Option<i32> {
    let deadline = orca_relay::clock::instant() + timeout;
    let code = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status.code().unwrap_or(-1);
        }
        if orca_relay::clock::instant() >= deadline {
            return None;
        }
        orca_relay::clock::sleep(Duration::from_millis(20));
    };
    for output in outputs {
        assert!(
            output.wait_drained(DRAIN_AFTER_EXIT),
            "the process exited but its output was not drained within {DRAIN_AFTER_EXIT:?}"
        );
    }
    Some(code)
}

/// A running relay process.
pub struct Relay {
    child: Child,
    log: Arc<ProcessLog>,
    pub ws: String,
    pub http: String,
    pub data_dir: Arc<TempDir>,
    /// The environment the process was started with (what an operator's command for it, such
    /// as `orca-relay handover`, runs with).
    pub env: Vec<(String, String)>,
}

/// A monotonic instant (the tests read time through the library's clock module too).
pub fn now_instant() -> std::time::Instant {
    orca_relay::clock::instant()
}

/// Waits for `condition` with a deadline, polling every 20 ms.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = orca_relay::clock::instant() + timeout;
    loop {
        if condition() {
            return true;
        }
        if orca_relay::clock::instant() >= deadline {
            return false;
        }
        orca_relay::clock::sleep(Duration::from_millis(20));
    }
}

impl Relay {
    /// Starts the combined role on SQLite with short test timings plus `env`.
    pub fn combined(env: &[(&str, &str)]) -> Relay {
        let dir = Arc::new(TempDir::new("relay"));
        Relay::start_in(dir, env)
    }

    /// Starts the binary and waits until it serves: its listening line, and for a director its
    /// migrations too (until then it answers a cell's registration 503 `starting`, and a cell
    /// refused at its startup handshake exits).
    pub fn start_in(data_dir: Arc<TempDir>, env: &[(&str, &str)]) -> Relay {
        Relay::launch(data_dir, env).expect_started()
    }

    /// As [`Relay::start_in`] with another build of the binary (the bench compares two).
    pub fn start_binary(
        binary: &std::path::Path,
        data_dir: Arc<TempDir>,
        env: &[(&str, &str)],
    ) -> Relay {
        Relay::launch_binary(binary, data_dir, env).expect_started()
    }

    /// Starts the binary without waiting for anything: for processes that are expected to fail
    /// at start or to stay in their startup handshake. Read the log with [`Relay::wait_for_log`]
    /// and call [`Relay::expect_listening`] to learn the addresses.
    pub fn launch(data_dir: Arc<TempDir>, env: &[(&str, &str)]) -> Relay {
        Relay::launch_binary(
            std::path::Path::new(env!("CARGO_BIN_EXE_orca-relay")),
            data_dir,
            env,
        )
    }

    /// As [`Relay::launch`] with another program (the harness's own tests run a script).
    pub fn launch_binary(
        binary: &std::path::Path,
        data_dir: Arc<TempDir>,
        env: &[(&str, &str)],
    ) -> Relay {
        Relay::launch_binary_with(binary, data_dir, env, |_| {})
    }

    /// Starts the combined role as [`Relay::combined`] with its descriptor limit (soft and hard
    /// `RLIMIT_NOFILE`) lowered to `nofile` before it runs, so that it reaches its capacity in
    /// seconds.
    pub fn combined_with_nofile(env: &[(&str, &str)], nofile: u64) -> Relay {
        use std::os::unix::process::CommandExt;
        let dir = Arc::new(TempDir::new("relay"));
        Relay::launch_binary_with(
            std::path::Path::new(env!("CARGO_BIN_EXE_orca-relay")),
            dir,
            env,
            move |command| {
                // SAFETY: the closure runs in the child between fork and exec and only calls
                // setrlimit, which is async-signal-safe.
                unsafe {
                    command.pre_exec(move || {
                        let limit = libc::rlimit {
                            rlim_cur: nofile,
                            rlim_max: nofile,
                        };
                        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
            },
        )
        .expect_listening("orca_relay_started")
    }

    /// As [`Relay::launch_binary`], `configure` applied to the command first (a `pre_exec`).
    pub fn launch_binary_with(
        binary: &std::path::Path,
        data_dir: Arc<TempDir>,
        env: &[(&str, &str)],
        configure: impl FnOnce(&mut Command),
    ) -> Relay {
        let mut command = Command::new(binary);
        configure(&mut command);
        command
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .env("ORCA_RELAY_WS_ADDR", "127.0.0.1:0")
            .env("ORCA_RELAY_HTTP_ADDR", "127.0.0.1:0")
            .env("ORCA_RELAY_DATA_DIR", &data_dir.0)
            // The test JWKS servers speak plain HTTP on loopback.
            .env("ORCA_RELAY_JWKS_ALLOW_HTTP", "1");
        let combined = env
            .iter()
            .all(|(name, value)| *name != "ORCA_RELAY_ROLE" || *value == "combined");
        // A combined relay with a JWKS gets no self-hosted key: the JWKS is its only key source.
        let jwks = env
            .iter()
            .any(|(name, value)| *name == "ORCA_RELAY_JWKS_URL" && !value.is_empty());
        if combined && !jwks {
            command.env("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY);
        }
        for (name, value) in env {
            command.env(name, value);
        }
        let env_used: Vec<(String, String)> = command
            .get_envs()
            .filter_map(|(name, value)| {
                Some((name.to_str()?.to_string(), value?.to_str()?.to_string()))
            })
            .collect();
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("start orca-relay");
        let stderr = child.stderr.take().expect("stderr");
        let log = ProcessLog::capture(stderr, "relay");
        Relay {
            child,
            log,
            ws: String::new(),
            http: String::new(),
            data_dir,
            env: env_used,
        }
    }

    /// Waits for the log line `event` carrying `ws=` (when the role has one) and `http=`, and
    /// takes the listener addresses from it: `orca_relay_started`, or `orca_relay_listening`
    /// for a cell that is still in its startup handshake.
    pub fn expect_listening(mut self, event: &str) -> Relay {
        let line = self
            .wait_for_log(event, Duration::from_secs(30))
            .unwrap_or_else(|| panic!("relay never logged {event}; log:\n{}", self.log_text()));
        self.ws = field(&line, "ws").unwrap_or_default();
        self.http = field(&line, "http").expect("http= in the listening line");
        self
    }

    /// [`Relay::expect_listening`] on `orca_relay_started`; a director is waited for until its
    /// migrations are applied.
    fn expect_started(self) -> Relay {
        let relay = self.expect_listening("orca_relay_started");
        let director = relay
            .env
            .iter()
            .any(|(name, value)| name == "ORCA_RELAY_ROLE" && value == "director");
        if director
            && relay
                .wait_for_log("orca_relay_migrations_applied", Duration::from_secs(30))
                .is_none()
        {
            panic!(
                "the director never applied its migrations; log:\n{}",
                relay.log_text()
            );
        }
        relay
    }

    /// Waits for a log line containing `needle`; returns it.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> Option<String> {
        self.log.wait_for(needle, timeout)
    }

    pub fn count_log(&self, needle: &str) -> usize {
        self.log.count(needle)
    }

    /// Waits until `count` lines contain `needle`: a line that reports something the test saw
    /// another way (a metric, an HTTP answer) may still be on its way through the pipe.
    pub fn wait_for_log_count(&self, needle: &str, count: usize, timeout: Duration) -> bool {
        wait_until(timeout, || self.log.count(needle) >= count) && self.log.count(needle) == count
    }

    pub fn log_text(&self) -> String {
        self.log.text()
    }

    pub fn ws_url(&self, path: &str) -> String {
        format!("ws://{}{}", self.ws, path)
    }

    pub fn http_url(&self, path: &str) -> String {
        format!("http://{}{}", self.http, path)
    }

    /// GET on the HTTP listener: (status, body).
    pub fn get(&self, path: &str) -> (u16, String) {
        http_result(
            ureq::get(&self.http_url(path))
                .timeout(Duration::from_secs(10))
                .call(),
        )
    }

    /// POST JSON with an optional bearer token: (status, body).
    pub fn post(&self, path: &str, bearer: Option<&str>, body: &str) -> (u16, String) {
        let mut request = ureq::post(&self.http_url(path))
            .timeout(Duration::from_secs(10))
            .set("Content-Type", "application/json");
        if let Some(token) = bearer {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        http_result(request.send_string(body))
    }

    /// The value of one metric line (exact name with labels), if present.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics");
        body.lines().find_map(|line| {
            line.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal to the process.
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status();
    }

    /// Waits for the process to exit and for its log to be drained (every line it wrote is
    /// in [`Relay::log_text`] once this returns); returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        wait_exit_drained(&mut self.child, &[&self.log], timeout)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http_result(result: Result<ureq::Response, ureq::Error>) -> (u16, String) {
    match result {
        Ok(response) => {
            let status = response.status();
            (status, response.into_string().unwrap_or_default())
        }
        Err(ureq::Error::Status(status, response)) => {
            (status, response.into_string().unwrap_or_default())
        }
        Err(e) => panic!("http request failed: {e}"),
    }
}

/// `key=value` from a log line.
pub fn field(line: &str, key: &str) -> Option<String> {
    line.split_whitespace()
        .find_map(|token| token.strip_prefix(&format!("{key}=")).map(str::to_string))
}

/// A desktop token minted with the test key.
pub fn token(user_id: &str, relay_host_id: &str) -> String {
    orca_relay::auth::mint_host_token(
        TEST_KEY,
        None,
        "orca-relay",
        user_id,
        relay_host_id,
        600,
        orca_relay::clock::system().as_ref(),
    )
}

/// A fresh 16-character relay host id.
pub fn host_id() -> String {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("h{:015}", (std::process::id() as u64) * 100_000 + n)
}

/// Opens a WebSocket; an upgrade refusal comes back as `Err(status)`.
pub fn ws_connect(url: &str, bearer: Option<&str>) -> Result<Ws, u16> {
    let mut request = url.into_client_request().expect("url");
    if let Some(token) = bearer {
        request
            .headers_mut()
            .insert("Authorization", format!("Bearer {token}").parse().unwrap());
    }
    let tcp = tcp_for(&request).unwrap_or_else(|e| panic!("connect {url}: {e}"));
    match ws_client(request, tcp) {
        Ok(ws) => {
            set_read_timeout(&ws, Some(Duration::from_secs(20)));
            Ok(ws)
        }
        Err(tungstenite::Error::Http(response)) => Err(response.status().as_u16()),
        Err(e) => panic!("connect {url}: {e}"),
    }
}

pub fn set_read_timeout(ws: &Ws, timeout: Option<Duration>) {
    ws.get_ref().set_read_timeout(timeout).unwrap();
}

pub fn send_json(ws: &mut Ws, value: serde_json::Value) {
    ws.send(Message::text(value.to_string())).expect("send");
}

/// Reads the next text message as JSON, skipping pings.
pub fn read_json(ws: &mut Ws) -> serde_json::Value {
    loop {
        match ws.read() {
            Ok(Message::Text(text)) => {
                let value: serde_json::Value = serde_json::from_str(&text).expect("json");
                if value["type"] == "ping" {
                    continue;
                }
                return value;
            }
            Ok(Message::Close(frame)) => panic!("closed while waiting for JSON: {frame:?}"),
            Ok(_) => continue,
            Err(e) => panic!("read failed while waiting for JSON: {e}"),
        }
    }
}

/// Waits for the relay's next ping on a control socket and answers it: proof that the socket
/// is open and the relay still serves it.
pub fn expect_ping(ws: &mut Ws) {
    loop {
        match ws.read() {
            Ok(Message::Text(text)) => {
                let value: serde_json::Value = serde_json::from_str(&text).expect("json");
                if value["type"] == "ping" {
                    send_json(ws, serde_json::json!({"type":"pong","t":value["t"]}));
                    return;
                }
            }
            Ok(Message::Close(frame)) => panic!("closed while waiting for a ping: {frame:?}"),
            Ok(_) => {}
            Err(e) => panic!("read failed while waiting for a ping: {e}"),
        }
    }
}

/// Reads until the close frame; returns its code (None if the connection just dropped).
pub fn read_close(ws: &mut Ws) -> Option<u16> {
    loop {
        match ws.read() {
            Ok(Message::Close(frame)) => return frame.map(|f| u16::from(f.code)),
            Ok(_) => continue,
            Err(_) => return None,
        }
    }
}

/// A desktop with an acked control socket.
pub struct Desktop {
    pub user_id: String,
    pub relay_host_id: String,
    pub token: String,
    pub epoch: i64,
    pub generation: u64,
    pub control: Ws,
}

impl Desktop {
    /// Assigns through `/v1/assign`, connects the control socket and waits for the ack.
    pub fn connect(relay: &Relay) -> Desktop {
        let relay_host_id = host_id();
        let user_id = format!("user-{relay_host_id}");
        let token = token(&user_id, &relay_host_id);
        Desktop::connect_with(relay, user_id, relay_host_id, token)
    }

    /// As [`Desktop::connect`], for a relay that verifies JWKS tokens ([`es256_token`]).
    pub fn connect_es256(relay: &Relay) -> Desktop {
        let relay_host_id = host_id();
        let user_id = format!("user-{relay_host_id}");
        let token = es256_token(&user_id, &relay_host_id);
        Desktop::connect_with(relay, user_id, relay_host_id, token)
    }

    pub fn connect_with(
        relay: &Relay,
        user_id: String,
        relay_host_id: String,
        token: String,
    ) -> Desktop {
        let epoch = assign(relay, &token, &relay_host_id);
        let mut control =
            ws_connect(&relay.ws_url("/v1/host/control"), Some(&token)).expect("control upgrade");
        send_json(
            &mut control,
            serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch}),
        );
        let ack = read_json(&mut control);
        assert_eq!(ack["type"], "host-hello-ack", "{ack}");
        let generation = ack["generation"].as_u64().unwrap();
        Desktop {
            user_id,
            relay_host_id,
            token,
            epoch,
            generation,
            control,
        }
    }

    /// Asks for an invite; a `rate_limited` refusal is waited out as its `retryAfterMs` says,
    /// as a desktop does.
    pub fn invite(&mut self) -> String {
        let created = loop {
            send_json(
                &mut self.control,
                serde_json::json!({"type":"invite-create","reqId":"r1"}),
            );
            let answer = read_json(&mut self.control);
            if answer["type"] == "invite-refused" && answer["reason"] == "rate_limited" {
                let wait = answer["retryAfterMs"].as_u64().unwrap_or(1000);
                orca_relay::clock::sleep(Duration::from_millis(wait));
                continue;
            }
            break answer;
        };
        assert_eq!(created["type"], "invite-created", "{created}");
        assert_eq!(created["reqId"], "r1");
        assert_eq!(created["maxAttempts"], 5);
        created["inviteToken"].as_str().unwrap().to_string()
    }

    /// Waits for `conn-open`; returns (connId, connTicket).
    pub fn conn_open(&mut self) -> (String, String) {
        let open = read_json(&mut self.control);
        assert_eq!(open["type"], "conn-open", "{open}");
        (
            open["connId"].as_str().unwrap().to_string(),
            open["connTicket"].as_str().unwrap().to_string(),
        )
    }

    pub fn data_leg(&self, relay: &Relay, conn_id: &str, ticket: &str) -> Ws {
        let mut leg = ws_connect(&relay.ws_url(&format!("/v1/host/data/{conn_id}")), None)
            .expect("data leg upgrade");
        send_json(
            &mut leg,
            serde_json::json!({"type":"host-data-auth","v":1,"connTicket":ticket,"generation":self.generation}),
        );
        leg
    }
}

/// `POST /v1/assign`: the epoch.
pub fn assign(relay: &Relay, token: &str, relay_host_id: &str) -> i64 {
    let (status, body) = relay.post(
        "/v1/assign",
        Some(token),
        &serde_json::json!({"v":1,"relayHostId":relay_host_id}).to_string(),
    );
    assert_eq!(status, 200, "assign: {body}");
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    value["assignmentEpoch"].as_i64().unwrap()
}

/// The relay threads' stacks of `pid` (their anonymous mappings of the relay stack's size):
/// how many, and the most and the mean of them resident, in bytes.
pub fn relay_stacks(pid: u32) -> (usize, u64, u64) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("read smaps");
    let stack_kib = (orca_relay::threads::RELAY_STACK_BYTES / 1024) as u64;
    let mut resident = Vec::new();
    let mut size = None;
    for line in smaps.lines() {
        let value = || {
            line.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        };
        if line.starts_with("Size:") {
            size = value();
        } else if line.starts_with("Rss:") && size == Some(stack_kib) {
            resident.push(value().unwrap_or(0) * 1024);
        }
    }
    let most = resident.iter().copied().max().unwrap_or(0);
    let mean = resident.iter().sum::<u64>() / (resident.len().max(1) as u64);
    (resident.len(), most, mean)
}

/// A phone spliced to a data leg: (phone, data leg).
pub fn splice(relay: &Relay, desktop: &mut Desktop) -> (Ws, Ws) {
    let invite = desktop.invite();
    let mut phone = ws_connect(
        &relay.ws_url(&format!("/v1/connect/{}", desktop.relay_host_id)),
        None,
    )
    .expect("phone upgrade");
    send_json(
        &mut phone,
        serde_json::json!({"type":"relay-auth","v":1,"credential":invite}),
    );
    let (conn_id, ticket) = desktop.conn_open();
    let leg = desktop.data_leg(relay, &conn_id, &ticket);
    let hello = read_json(&mut phone);
    assert_eq!(hello, serde_json::json!({"type":"relay-hello","ok":true}));
    (phone, leg)
}

// ---------------------------------------------------------------------------------------------
// Fake servers: a JWKS, a director.

/// One request a fake server received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub authorization: Option<String>,
    pub body: String,
}

type FakeHandler = dyn Fn(&Seen) -> (u16, String) + Send + Sync;

/// A local HTTP server whose answers a test chooses; it records every request.
pub struct FakeServer {
    pub addr: std::net::SocketAddr,
    server: Arc<tiny_http::Server>,
    seen: Arc<Mutex<Vec<Seen>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeServer {
    pub fn start(handler: impl Fn(&Seen) -> (u16, String) + Send + Sync + 'static) -> FakeServer {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").expect("bind fake server"));
        let addr = server.server_addr().to_ip().expect("ip listener");
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let handler: Arc<FakeHandler> = Arc::new(handler);
        let thread = {
            let server = server.clone();
            let seen = seen.clone();
            orca_relay::threads::spawn("test-fake-http", move || {
                while let Ok(mut request) = server.recv() {
                    let mut body = String::new();
                    let _ = std::io::Read::read_to_string(request.as_reader(), &mut body);
                    let entry = Seen {
                        method: request.method().as_str().to_string(),
                        path: request.url().to_string(),
                        authorization: request
                            .headers()
                            .iter()
                            .find(|h| h.field.equiv("Authorization"))
                            .map(|h| h.value.as_str().to_string()),
                        body,
                    };
                    let (status, answer) = handler(&entry);
                    seen.lock().unwrap().push(entry);
                    let response = tiny_http::Response::from_string(answer)
                        .with_status_code(status)
                        .with_header(
                            tiny_http::Header::from_bytes("Content-Type", "application/json")
                                .unwrap(),
                        );
                    let _ = request.respond(response);
                }
            })
            .expect("spawn fake server")
        };
        FakeServer {
            addr,
            server,
            seen,
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

pub const TEST_ISSUER: &str = "https://auth.test";
pub const TEST_KID: &str = "test-ec";
pub const SERVICE_TOKEN: &str = "test-service-token";
const EC_PRIVATE_PEM: &str = include_str!("../fixtures/auth/ec-p256-private.pem");

fn ec_key() -> jsonwebtoken::EncodingKey {
    jsonwebtoken::EncodingKey::from_ec_pem(EC_PRIVATE_PEM.as_bytes()).expect("EC fixture")
}

/// The JWKS body with the test EC key.
pub fn jwks_body() -> String {
    let jwk = jsonwebtoken::jwk::Jwk::from_encoding_key(&ec_key(), jsonwebtoken::Algorithm::ES256)
        .expect("jwk");
    let mut value = serde_json::to_value(jwk).unwrap();
    let object = value.as_object_mut().unwrap();
    object.remove("alg");
    object.insert("kid".into(), serde_json::json!(TEST_KID));
    serde_json::json!({ "keys": [value] }).to_string()
}

/// A JWKS server with the test key.
pub fn jwks_server() -> FakeServer {
    let body = jwks_body();
    FakeServer::start(move |_| (200, body.clone()))
}

/// An ES256 desktop token signed with the test key.
pub fn es256_token(user_id: &str, relay_host_id: &str) -> String {
    es256_token_with_kid(TEST_KID, user_id, relay_host_id)
}

/// As [`es256_token`], naming another `kid` in its header (a key the relay may not know yet).
pub fn es256_token_with_kid(kid: &str, user_id: &str, relay_host_id: &str) -> String {
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
    header.kid = Some(kid.to_string());
    let now = orca_relay::clock::system().now_ms() / 1000;
    let claims = serde_json::json!({
        "sub": user_id, "relayHostId": relay_host_id, "purpose": "host-control",
        "aud": "orca-relay", "iss": TEST_ISSUER, "exp": now + 600,
    });
    jsonwebtoken::encode(&header, &claims, &ec_key()).expect("sign")
}

/// A director that accepts every registration and heartbeat.
pub fn accepting_director() -> FakeServer {
    FakeServer::start(|_| (200, r#"{"v":1,"ok":true}"#.to_string()))
}

/// The environment of a `cell` role test process.
pub fn cell_env(
    cell_id: &str,
    jwks: &FakeServer,
    directors: &[&FakeServer],
) -> Vec<(String, String)> {
    let urls: Vec<String> = directors.iter().map(|d| d.url()).collect();
    vec![
        ("ORCA_RELAY_ROLE".into(), "cell".into()),
        ("ORCA_RELAY_CELL_ID".into(), cell_id.into()),
        ("ORCA_RELAY_SERVICE_TOKEN".into(), SERVICE_TOKEN.into()),
        (
            "ORCA_RELAY_JWKS_URL".into(),
            format!("{}/jwks.json", jwks.url()),
        ),
        ("ORCA_RELAY_AUTH_ISSUER".into(), TEST_ISSUER.into()),
        // The fake JWKS is plain HTTP; the operator's own commands run with this env too.
        ("ORCA_RELAY_JWKS_ALLOW_HTTP".into(), "1".into()),
        ("ORCA_RELAY_DIRECTOR_URLS".into(), urls.join(",")),
    ]
}

/// Borrowed view of an owned env list for [`Relay::start_in`].
pub fn env_refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Writes the cell's switch file atomically (write + rename), as operators do.
pub fn write_switch(
    path: &std::path::Path,
    cell_id: &str,
    generation: u64,
    flags: serde_json::Value,
) {
    let body = serde_json::json!({"v":1,"cellId":cell_id,"generation":generation,"flags":flags});
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body.to_string()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

impl Relay {
    /// Service-token GET on the cell's internal API.
    pub fn internal_get(&self, path: &str) -> (u16, String) {
        http_result(
            ureq::get(&self.http_url(path))
                .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
                .timeout(Duration::from_secs(10))
                .call(),
        )
    }

    /// Books a seat as a director would.
    pub fn book(&self, user_id: &str, relay_host_id: &str, epoch: i64) -> String {
        let body = serde_json::json!({"v":1,"directorId":"test-director","items":[
            {"userId":user_id,"relayHostId":relay_host_id,"epoch":epoch,"ttlMs":30000}]});
        let (status, answer) =
            self.post("/internal/reserve", Some(SERVICE_TOKEN), &body.to_string());
        assert_eq!(status, 200, "reserve: {answer}");
        let value: serde_json::Value = serde_json::from_str(&answer).unwrap();
        value["results"][0]["outcome"].as_str().unwrap().to_string()
    }
}

/// Opens a control with a token and sends the hello; returns the socket after the ack, or the
/// close code.
pub fn hello(
    relay: &Relay,
    token: &str,
    relay_host_id: &str,
    epoch: i64,
) -> Result<(Ws, u64), Option<u16>> {
    let mut control = ws_connect(&relay.ws_url("/v1/host/control"), Some(token)).map_err(Some)?;
    send_json(
        &mut control,
        serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch}),
    );
    loop {
        match control.read() {
            Ok(Message::Text(text)) => {
                let value: serde_json::Value = serde_json::from_str(&text).unwrap();
                if value["type"] == "host-hello-ack" {
                    return Ok((control, value["generation"].as_u64().unwrap()));
                }
            }
            Ok(Message::Close(frame)) => return Err(frame.map(|f| u16::from(f.code))),
            Ok(_) => {}
            Err(_) => return Err(None),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A server that can be stopped and started again on the same port, and a systemd stand-in.

type PathHandler = dyn Fn(&str) -> (u16, String) + Send + Sync;

/// A minimal HTTP server on a fixed port that a test can stop (the port then refuses
/// connections) and start again on the same port: a dependency going away and coming back.
/// One request per connection, answered with `Connection: close`, so no pooled connection
/// outlives a stop.
pub struct RestartableServer {
    pub addr: std::net::SocketAddr,
    handler: Arc<PathHandler>,
    running: Option<(
        Arc<std::sync::atomic::AtomicBool>,
        std::thread::JoinHandle<()>,
    )>,
    served: Arc<AtomicU64>,
}

impl RestartableServer {
    /// Starts on a free port; `handler` maps a request path to (status, body).
    pub fn start(handler: impl Fn(&str) -> (u16, String) + Send + Sync + 'static) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind restartable");
        let mut server = RestartableServer {
            addr: listener.local_addr().expect("local addr"),
            handler: Arc::new(handler),
            running: None,
            served: Arc::default(),
        };
        server.serve(listener);
        server
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests answered so far.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }

    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Stops accepting and closes the listener: from now on the port refuses connections.
    pub fn stop(&mut self) {
        if let Some((stop, thread)) = self.running.take() {
            stop.store(true, Ordering::SeqCst);
            // Unblocks the accept call; the loop sees the flag and drops the listener.
            let _ = TcpStream::connect(self.addr);
            thread.join().expect("restartable server thread");
        }
    }

    /// Binds the same port again and serves.
    pub fn restart(&mut self) {
        assert!(self.running.is_none(), "already running");
        let deadline = orca_relay::clock::instant() + Duration::from_secs(10);
        let listener = loop {
            match std::net::TcpListener::bind(self.addr) {
                Ok(listener) => break listener,
                Err(e) if orca_relay::clock::instant() < deadline => {
                    let _ = e;
                    orca_relay::clock::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("rebind {}: {e}", self.addr),
            }
        };
        self.serve(listener);
    }

    fn serve(&mut self, listener: std::net::TcpListener) {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let handler = self.handler.clone();
        let served = self.served.clone();
        let flag = stop.clone();
        let thread = orca_relay::threads::spawn("test-restartable", move || {
            for stream in listener.incoming() {
                if flag.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut stream) = stream else { continue };
                let Some(path) = read_request_path(&mut stream) else {
                    continue;
                };
                let (status, body) = handler(&path);
                let answer = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = std::io::Write::write_all(&mut stream, answer.as_bytes());
                served.fetch_add(1, Ordering::SeqCst);
            }
        })
        .expect("spawn restartable server");
        self.running = Some((stop, thread));
    }
}

impl Drop for RestartableServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Reads one request head (and ignores any body); returns the request path.
pub fn read_request_path(stream: &mut TcpStream) -> Option<String> {
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = std::io::Read::read(stream, &mut buf).ok()?;
        if n == 0 {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > 64 * 1024 {
            return None;
        }
    }
    let text = String::from_utf8_lossy(&head);
    text.split_whitespace().nth(1).map(str::to_string)
}

/// A JWKS server with the test key that can be stopped and restarted on the same port.
pub fn restartable_jwks_server() -> RestartableServer {
    let body = jwks_body();
    RestartableServer::start(move |_| (200, body.clone()))
}

/// A bound unix datagram socket standing in for systemd's `NOTIFY_SOCKET`.
pub struct NotifySocket {
    pub path: PathBuf,
    socket: std::os::unix::net::UnixDatagram,
    received: Mutex<Vec<String>>,
    _dir: TempDir,
}

impl NotifySocket {
    pub fn new() -> NotifySocket {
        let dir = TempDir::new("notify");
        let path = dir.0.join("notify.sock");
        let socket = std::os::unix::net::UnixDatagram::bind(&path).expect("bind notify socket");
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("notify read timeout");
        NotifySocket {
            path,
            socket,
            received: Mutex::default(),
            _dir: dir,
        }
    }

    /// The value for `NOTIFY_SOCKET`.
    pub fn env_value(&self) -> String {
        self.path.display().to_string()
    }

    /// Reads every datagram waiting now into the received list; returns the whole list.
    pub fn drain(&self) -> Vec<String> {
        let mut received = self.received.lock().unwrap();
        let mut buf = [0u8; 4096];
        while let Ok(n) = self.socket.recv(&mut buf) {
            received.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        received.clone()
    }

    /// How many datagrams equal to `message` arrived so far.
    pub fn count(&self, message: &str) -> usize {
        self.drain().iter().filter(|m| *m == message).count()
    }

    /// Waits until `count` datagrams equal to `message` have arrived.
    pub fn wait_for(&self, message: &str, count: usize, timeout: Duration) -> bool {
        wait_until(timeout, || self.count(message) >= count)
    }
}

impl Default for NotifySocket {
    fn default() -> Self {
        NotifySocket::new()
    }
}

/// How an attempted WebSocket upgrade ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Upgrade {
    /// 101: the socket is open.
    Opened,
    /// The upgrade was answered with this HTTP status.
    Status(u16),
    /// The TCP connection was refused, reset or closed without an answer.
    NoAnswer,
}

/// Tries an upgrade without panicking on transport errors.
pub fn try_upgrade(url: &str, bearer: Option<&str>) -> Upgrade {
    let mut request = url.into_client_request().expect("url");
    if let Some(token) = bearer {
        request
            .headers_mut()
            .insert("Authorization", format!("Bearer {token}").parse().unwrap());
    }
    match tungstenite::connect(request) {
        Ok(_) => Upgrade::Opened,
        Err(tungstenite::Error::Http(response)) => Upgrade::Status(response.status().as_u16()),
        Err(_) => Upgrade::NoAnswer,
    }
}

/// Keeps a cell's director "up" from the cell's point of view: a `reserver=1` seat-feed poll
/// (dead-man contact) every 100 ms until stopped or dropped. [`DirectorPolls::pause`] holds the
/// polls back (a VM pause drops the packets a director sends meanwhile: nothing waits in the
/// cell's kernel to count as contact the moment it resumes).
pub struct DirectorPolls {
    state: Arc<(Mutex<PollState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PollState {
    Polling,
    /// Asked to pause; the thread has not finished its poll in flight yet.
    Pausing,
    Paused,
    Stopped,
}

impl DirectorPolls {
    pub fn start(relay: &Relay) -> DirectorPolls {
        let state = Arc::new((Mutex::new(PollState::Polling), Condvar::new()));
        let url = relay.http_url("/internal/seats?reserver=1");
        let shared = state.clone();
        let thread = orca_relay::threads::spawn("test-director-polls", move || loop {
            {
                let (lock, changed) = &*shared;
                let mut state = lock.lock().unwrap();
                loop {
                    match *state {
                        PollState::Polling => break,
                        PollState::Stopped => return,
                        PollState::Pausing => {
                            *state = PollState::Paused;
                            changed.notify_all();
                        }
                        PollState::Paused => {}
                    }
                    state = changed.wait(state).unwrap();
                }
            }
            let _ = ureq::get(&url)
                .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
                .timeout(Duration::from_secs(2))
                .call();
            orca_relay::clock::sleep(Duration::from_millis(100));
        })
        .expect("spawn director polls");
        DirectorPolls {
            state,
            thread: Some(thread),
        }
    }

    fn set(&self, next: PollState) {
        let (lock, changed) = &*self.state;
        *lock.lock().unwrap() = next;
        changed.notify_all();
    }

    /// Stops polling, once the poll in flight (if any) has been answered.
    pub fn pause(&self) {
        self.set(PollState::Pausing);
        let (lock, changed) = &*self.state;
        let mut state = lock.lock().unwrap();
        while *state == PollState::Pausing {
            state = changed.wait(state).unwrap();
        }
    }

    /// Polls again.
    pub fn resume(&self) {
        self.set(PollState::Polling);
    }

    /// The director outage begins.
    pub fn stop(&mut self) {
        self.set(PollState::Stopped);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for DirectorPolls {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------------------------
// Pausing the process: SIGSTOP, a wait, SIGCONT (a hypervisor pause, `docker pause`, `gdb -p`).

/// The state letter of a process in `/proc/<pid>/stat` (`T` = stopped).
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

impl Relay {
    /// Stops the process with SIGSTOP, runs `while_stopped`, keeps it stopped for `duration`
    /// in all (from the moment the kernel reports it stopped), then continues it with SIGCONT.
    pub fn freeze_for(&self, duration: Duration, while_stopped: impl FnOnce()) {
        let pid = self.child.id();
        // SAFETY: kill has no memory-safety preconditions; the pid is our own child.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
        assert!(
            wait_until(Duration::from_secs(5), || process_state(pid) == Some('T')),
            "the relay did not stop"
        );
        let stopped_at = orca_relay::clock::instant();
        while_stopped();
        // The freeze itself (not a wait for a condition): the scenario is "stopped this long".
        orca_relay::clock::sleep(duration.saturating_sub(stopped_at.elapsed()));
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) }, 0);
        assert!(
            wait_until(Duration::from_secs(5), || process_state(pid) != Some('T')),
            "the relay did not continue"
        );
    }
}
