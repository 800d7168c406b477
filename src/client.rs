//! `orca-relay client host` and `client phone`: small CLI peers for smoke tests by hand.
//!
//! The host asks the director for a placement, holds a control socket, prints the command a
//! phone runs (with a fresh invite) and echoes every frame a phone sends. It behaves as a
//! desktop should (docs/PROTOCOL.md): on a `drain` frame, a 4503, a 4409, a refused upgrade or a
//! lost connection it goes back to `/v1/assign` (with `"reconnect":true`) and reconnects,
//! backing off while the director or the cell does not answer. It exits 0 only when told to
//! stop (SIGINT or SIGTERM: the control is closed with 1000 first), and 1 on what retrying
//! cannot fix: a refused token (HTTP 401/403, close 4401) or a newer control for the same host
//! (4408). Standard input is not read, so it runs as well in the background.
//!
//! The phone connects with an invite and pipes stdin to the host and the host's frames to
//! stdout.

use std::io::{BufRead, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tungstenite::protocol::CloseFrame;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

use crate::clock;
use crate::protocol::CloseCode;

type Ws = WebSocket<MaybeTlsStream<TcpStream>>;

/// How often a blocked control read wakes up to look at the stop flag.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// Backoff between attempts that failed: 250 ms, doubling, capped at 5 s.
const BACKOFF_FIRST: Duration = Duration::from_millis(250);
const BACKOFF_CAP: Duration = Duration::from_secs(5);

/// Options of `client host`.
#[derive(Debug, Clone)]
pub struct HostOptions {
    pub director: String,
    pub relay_host_id: String,
    pub user_id: String,
    pub token: String,
}

/// Options of `client phone`.
#[derive(Debug, Clone)]
pub struct PhoneOptions {
    pub cell_url: String,
    pub relay_host_id: String,
    pub invite: String,
}

/// A random relay host id: 16 characters of `[A-Za-z0-9_-]`; `Err` when the OS random source
/// fails (no id is made up in its place).
pub fn random_host_id() -> Result<String, String> {
    crate::cell::state::random_token()
        .map(|token| token[..16].to_string())
        .map_err(|_| "cannot make a relay host id: the OS random source failed".to_string())
}

/// Connects a WebSocket with an optional bearer token.
pub fn connect(url: &str, bearer: Option<&str>) -> Result<Ws, String> {
    connect_ws(url, bearer).map_err(|e| e.message)
}

/// A failed WebSocket connect: the upgrade's HTTP status when the server answered one.
struct ConnectError {
    status: Option<u16>,
    message: String,
}

fn connect_ws(url: &str, bearer: Option<&str>) -> Result<Ws, ConnectError> {
    let failed = |status, message| ConnectError { status, message };
    let mut request = url
        .into_client_request()
        .map_err(|e| failed(None, format!("bad url {url}: {e}")))?;
    if let Some(token) = bearer {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| failed(None, "token is not a valid header value".to_string()))?;
        request.headers_mut().insert("Authorization", value);
    }
    match tungstenite::connect(request) {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::Error::Http(response)) => {
            let status = response.status().as_u16();
            Err(failed(
                Some(status),
                format!("{url} refused the upgrade with HTTP {status}"),
            ))
        }
        Err(e) => Err(failed(None, format!("cannot connect to {url}: {e}"))),
    }
}

/// Why asking the director failed.
#[derive(Debug)]
enum AssignError {
    /// Worth asking again later: the director did not answer, or answered 5xx.
    Retry(String),
    /// Asking again cannot help (a refused token, a bad request).
    Fatal(String),
}

/// Asks the director for a placement: `(cellUrl, assignmentEpoch)`.
pub fn assign(director: &str, token: &str, relay_host_id: &str) -> Result<(String, i64), String> {
    assign_placement(director, token, relay_host_id, false).map_err(|e| match e {
        AssignError::Retry(message) | AssignError::Fatal(message) => message,
    })
}

fn assign_placement(
    director: &str,
    token: &str,
    relay_host_id: &str,
    reconnect: bool,
) -> Result<(String, i64), AssignError> {
    let url = format!("{}/v1/assign", director.trim_end_matches('/'));
    let mut body = serde_json::json!({"v": 1, "relayHostId": relay_host_id});
    if reconnect {
        body["reconnect"] = serde_json::Value::Bool(true);
    }
    let response = ureq::post(&url)
        .set("Authorization", &format!("Bearer {token}"))
        .timeout(Duration::from_secs(10))
        .send_json(body);
    let body: serde_json::Value = match response {
        Ok(response) => response
            .into_json()
            .map_err(|e| AssignError::Retry(format!("bad answer from {url}: {e}")))?,
        Err(ureq::Error::Status(code, response)) => {
            let text = response.into_string().unwrap_or_default();
            let message = format!("{url} answered HTTP {code}: {}", text.trim());
            return Err(if code >= 500 || code == 429 {
                AssignError::Retry(message)
            } else {
                AssignError::Fatal(message)
            });
        }
        Err(e) => return Err(AssignError::Retry(format!("cannot reach {url}: {e}"))),
    };
    let cell_url = body["cellUrl"]
        .as_str()
        .ok_or_else(|| AssignError::Retry(format!("{url} answered without cellUrl")))?
        .to_string();
    let epoch = body["assignmentEpoch"]
        .as_i64()
        .ok_or_else(|| AssignError::Retry(format!("{url} answered without assignmentEpoch")))?;
    Ok((cell_url, epoch))
}

fn send_json(ws: &mut Ws, value: serde_json::Value) -> Result<(), String> {
    ws.send(Message::text(value.to_string()))
        .map_err(|e| format!("send failed: {e}"))
}

/// The path of the running executable, quoted for a POSIX shell when it needs it, so the
/// printed phone command runs as printed (a bare `orca-relay` is not on the PATH of someone
/// who built with cargo).
pub fn executable_for_shell() -> String {
    let path = std::env::current_exe()
        .map(|path| path.display().to_string())
        .unwrap_or_else(|_| "orca-relay".to_string());
    shell_quote(&path)
}

fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+:@%,=".contains(&b));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// How one control session ended.
#[derive(Debug)]
enum SessionEnd {
    /// Told to stop; the control was closed with 1000.
    Stopped,
    /// Go back to the director (drain, 4503, 4409, refused upgrade, lost connection).
    /// `admitted`: the session got its hello acked, so the first retry need not wait.
    Resolve { why: String, admitted: bool },
    /// Retrying cannot help.
    Fatal(String),
}

/// Runs the desktop peer until `stop` is set (exit 0) or a failure that retrying cannot fix.
pub fn run_host(options: &HostOptions, stop: &AtomicBool) -> Result<(), String> {
    let mut backoff = BACKOFF_FIRST;
    let mut reconnect = false;
    loop {
        if stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let placement = assign_placement(
            &options.director,
            &options.token,
            &options.relay_host_id,
            reconnect,
        );
        reconnect = true;
        let (cell_url, epoch) = match placement {
            Ok(placement) => placement,
            Err(AssignError::Fatal(message)) => return Err(message),
            Err(AssignError::Retry(message)) => {
                eprintln!(
                    "host: {message}; asking again in {} ms",
                    backoff.as_millis()
                );
                wait_unless_stopped(backoff, stop);
                backoff = (backoff * 2).min(BACKOFF_CAP);
                continue;
            }
        };
        match hold_control(options, &cell_url, epoch, stop) {
            SessionEnd::Stopped => return Ok(()),
            SessionEnd::Fatal(message) => return Err(message),
            SessionEnd::Resolve { why, admitted } => {
                if admitted {
                    // A session that worked: ask the director again at once.
                    backoff = BACKOFF_FIRST;
                    eprintln!("host: {why}; asking the director for a placement again");
                } else {
                    eprintln!(
                        "host: {why}; asking the director again in {} ms",
                        backoff.as_millis()
                    );
                    wait_unless_stopped(backoff, stop);
                    backoff = (backoff * 2).min(BACKOFF_CAP);
                }
            }
        }
    }
}

fn wait_unless_stopped(duration: Duration, stop: &AtomicBool) {
    let deadline = clock::instant() + duration;
    while !stop.load(Ordering::SeqCst) {
        let left = deadline.saturating_duration_since(clock::instant());
        if left.is_zero() {
            return;
        }
        clock::sleep(left.min(STOP_CHECK));
    }
}

/// One control session on `cell_url` at `epoch`.
fn hold_control(
    options: &HostOptions,
    cell_url: &str,
    epoch: i64,
    stop: &AtomicBool,
) -> SessionEnd {
    let resolve = |why: String, admitted: bool| SessionEnd::Resolve { why, admitted };
    let url = format!("{cell_url}/v1/host/control");
    let mut control = match connect_ws(&url, Some(&options.token)) {
        Ok(control) => control,
        Err(ConnectError {
            status: Some(401 | 403),
            message,
        }) => return SessionEnd::Fatal(format!("{message}: the token was refused")),
        Err(e) => return resolve(e.message, false),
    };
    if let MaybeTlsStream::Plain(stream) = control.get_ref() {
        // Wake up now and then to notice a stop request.
        let _ = stream.set_read_timeout(Some(STOP_CHECK));
    }
    let hello = serde_json::json!({"type": "host-hello", "v": 1, "relayHostId": options.relay_host_id, "assignmentEpoch": epoch});
    let invite = serde_json::json!({"type": "invite-create", "reqId": 1});
    if let Err(e) = send_json(&mut control, hello).and_then(|()| send_json(&mut control, invite)) {
        return resolve(e, false);
    }
    let mut generation = 0u64;
    let mut admitted = false;
    loop {
        if stop.load(Ordering::SeqCst) {
            close_control(&mut control, WsCloseCode::Normal, "host stopping");
            return SessionEnd::Stopped;
        }
        let message = match control.read() {
            Ok(message) => message,
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => return resolve(format!("control socket lost: {e}"), admitted),
        };
        let text = match message {
            Message::Text(text) => text.to_string(),
            Message::Close(frame) => {
                let code = frame.map(|f| u16::from(f.code)).unwrap_or(1005);
                return on_close(code, admitted);
            }
            _ => continue,
        };
        let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        match value["type"].as_str() {
            Some("host-hello-ack") => {
                generation = value["generation"].as_u64().unwrap_or(0);
                admitted = true;
                eprintln!("host: admitted on {cell_url} at epoch {epoch}, generation {generation}");
            }
            Some("invite-created") => {
                let invite = value["inviteToken"].as_str().unwrap_or_default();
                println!(
                    "{} client phone --cell {cell_url} --relay-host-id {} --invite {invite}",
                    executable_for_shell(),
                    options.relay_host_id
                );
                let _ = std::io::stdout().flush();
            }
            Some("ping") => {
                let _ = send_json(
                    &mut control,
                    serde_json::json!({"type": "pong", "t": value["t"]}),
                );
            }
            Some("conn-open") => {
                let conn_id = value["connId"].as_str().unwrap_or_default().to_string();
                let ticket = value["connTicket"].as_str().unwrap_or_default().to_string();
                let url = format!("{cell_url}/v1/host/data/{conn_id}");
                let spawned = crate::threads::spawn(format!("client-data-{conn_id}"), move || {
                    if let Err(e) = echo_data_leg(&url, &ticket, generation) {
                        eprintln!("host: data leg ended: {e}");
                    }
                });
                if let Err(e) = spawned {
                    eprintln!("host: cannot start a data leg: {e}");
                }
            }
            Some("drain") => {
                // The cell is going away: leave now and get a placement elsewhere, rather than
                // wait for the 4503 at the end of its grace.
                close_control(&mut control, WsCloseCode::Normal, "following drain");
                return resolve("the relay is draining".to_string(), admitted);
            }
            _ => {}
        }
    }
}

/// What a close code from the relay means for the host (docs/PROTOCOL.md, close codes).
fn on_close(code: u16, admitted: bool) -> SessionEnd {
    let why = |what: &str| format!("the relay closed the control with {code} ({what})");
    match CloseCode::ALL.into_iter().find(|c| c.code() == code) {
        Some(CloseCode::BadOuterCredential) => {
            SessionEnd::Fatal(why("bad credential: check the token"))
        }
        Some(CloseCode::PeerDropped) => SessionEnd::Fatal(why(
            "replaced by a newer control for this host, or silent too long",
        )),
        Some(CloseCode::Draining) => SessionEnd::Resolve {
            why: why("draining or the lease moved"),
            admitted,
        },
        Some(CloseCode::WrongCell) => SessionEnd::Resolve {
            why: why("wrong cell for this placement"),
            admitted,
        },
        _ => SessionEnd::Resolve {
            why: why("closed"),
            admitted,
        },
    }
}

/// Sends a close frame and waits briefly for the relay's answer.
fn close_control(control: &mut Ws, code: WsCloseCode, reason: &str) {
    let _ = control.close(Some(CloseFrame {
        code,
        reason: reason.to_string().into(),
    }));
    let deadline = clock::instant() + Duration::from_secs(1);
    while clock::instant() < deadline {
        match control.read() {
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

/// Sets `stop` on SIGINT or SIGTERM (the flag is read by [`run_host`]).
pub fn stop_on_signals() -> Result<Arc<AtomicBool>, String> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, stop.clone())
            .map_err(|e| format!("cannot install the signal handler: {e}"))?;
    }
    Ok(stop)
}

fn echo_data_leg(url: &str, ticket: &str, generation: u64) -> Result<(), String> {
    let mut leg = connect(url, None)?;
    send_json(
        &mut leg,
        serde_json::json!({"type": "host-data-auth", "v": 1, "connTicket": ticket, "generation": generation}),
    )?;
    eprintln!("host: phone attached");
    loop {
        match leg.read() {
            Ok(message @ (Message::Text(_) | Message::Binary(_))) => {
                leg.send(message).map_err(|e| format!("send failed: {e}"))?;
            }
            Ok(Message::Close(_)) => return Ok(()),
            Ok(_) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Runs the phone peer: stdin lines go to the host, the host's frames go to stdout.
pub fn run_phone(options: &PhoneOptions) -> Result<(), String> {
    let url = format!(
        "{}/v1/connect/{}",
        options.cell_url.trim_end_matches('/'),
        options.relay_host_id
    );
    let mut ws = connect(&url, None)?;
    send_json(
        &mut ws,
        serde_json::json!({"type": "relay-auth", "v": 1, "credential": options.invite}),
    )?;
    match ws.read() {
        Ok(Message::Text(text)) if text.contains("relay-hello") => eprintln!("phone: connected"),
        Ok(Message::Close(frame)) => {
            let code = frame.map(|f| u16::from(f.code)).unwrap_or(1005);
            return Err(format!("refused by the relay with code {code}"));
        }
        Ok(other) => return Err(format!("unexpected first message: {other:?}")),
        Err(e) => return Err(format!("connection failed: {e}")),
    }
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    for line in stdin.lock().lines() {
        let line = line.map_err(|e| format!("stdin: {e}"))?;
        ws.send(Message::text(line))
            .map_err(|e| format!("send failed: {e}"))?;
        match ws.read() {
            Ok(Message::Text(text)) => {
                let _ = writeln!(stdout, "{text}");
            }
            Ok(Message::Binary(bytes)) => {
                let _ = writeln!(stdout, "<{} bytes>", bytes.len());
            }
            Ok(Message::Close(frame)) => {
                let code = frame.map(|f| u16::from(f.code)).unwrap_or(1005);
                return Err(format!("closed by the relay with code {code}"));
            }
            Ok(_) => {}
            Err(e) => return Err(format!("connection failed: {e}")),
        }
    }
    let _ = ws.close(None);
    let deadline = clock::instant() + Duration::from_secs(1);
    while clock::instant() < deadline {
        if ws.read().is_err() {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_printed_executable_survives_a_shell() {
        assert_eq!(
            shell_quote("/home/me/orca/target/release/orca-relay"),
            "/home/me/orca/target/release/orca-relay"
        );
        assert_eq!(
            shell_quote("/tmp/my dir/orca-relay"),
            "'/tmp/my dir/orca-relay'"
        );
        assert_eq!(shell_quote("/tmp/it's/x"), "'/tmp/it'\\''s/x'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn close_codes_map_to_what_a_desktop_should_do() {
        let resolves = |code| matches!(on_close(code, true), SessionEnd::Resolve { .. });
        let fatal = |code| matches!(on_close(code, true), SessionEnd::Fatal(_));
        assert!(resolves(4503), "draining: back to the director");
        assert!(resolves(4409), "wrong cell: back to the director");
        assert!(resolves(4429), "transient: try again");
        assert!(resolves(1001));
        assert!(fatal(4401), "a refused token does not get better");
        assert!(fatal(4408), "a newer control took over");
    }
}
