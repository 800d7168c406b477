//! `orca-relay client host` and `client phone`: small CLI peers for smoke tests by hand.
//!
//! The host asks the director for a placement, holds a control socket, prints an invite and
//! echoes every frame a phone sends. The phone connects with that invite and pipes stdin to the
//! host and the host's frames to stdout.

use std::io::{BufRead, Write};
use std::net::TcpStream;
use std::time::Duration;

use tungstenite::client::IntoClientRequest;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

use crate::clock;

type Ws = WebSocket<MaybeTlsStream<TcpStream>>;

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

/// A random relay host id: 16 characters of `[A-Za-z0-9_-]`.
pub fn random_host_id() -> String {
    crate::cell::state::random_token()[..16].to_string()
}

/// Connects a WebSocket with an optional bearer token.
pub fn connect(url: &str, bearer: Option<&str>) -> Result<Ws, String> {
    let mut request = url
        .into_client_request()
        .map_err(|e| format!("bad url {url}: {e}"))?;
    if let Some(token) = bearer {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| "token is not a valid header value".to_string())?;
        request.headers_mut().insert("Authorization", value);
    }
    tungstenite::connect(request)
        .map(|(ws, _)| ws)
        .map_err(|e| format!("cannot connect to {url}: {e}"))
}

/// Asks the director for a placement: `(cellUrl, assignmentEpoch)`.
pub fn assign(director: &str, token: &str, relay_host_id: &str) -> Result<(String, i64), String> {
    let url = format!("{}/v1/assign", director.trim_end_matches('/'));
    let response = ureq::post(&url)
        .set("Authorization", &format!("Bearer {token}"))
        .timeout(Duration::from_secs(10))
        .send_json(serde_json::json!({"v": 1, "relayHostId": relay_host_id}));
    let body: serde_json::Value = match response {
        Ok(response) => response
            .into_json()
            .map_err(|e| format!("bad answer from {url}: {e}"))?,
        Err(ureq::Error::Status(code, response)) => {
            let text = response.into_string().unwrap_or_default();
            return Err(format!("{url} answered HTTP {code}: {text}"));
        }
        Err(e) => return Err(format!("cannot reach {url}: {e}")),
    };
    let cell_url = body["cellUrl"]
        .as_str()
        .ok_or_else(|| format!("{url} answered without cellUrl"))?
        .to_string();
    let epoch = body["assignmentEpoch"]
        .as_i64()
        .ok_or_else(|| format!("{url} answered without assignmentEpoch"))?;
    Ok((cell_url, epoch))
}

fn send_json(ws: &mut Ws, value: serde_json::Value) -> Result<(), String> {
    ws.send(Message::text(value.to_string()))
        .map_err(|e| format!("send failed: {e}"))
}

/// Runs the desktop peer until its control socket closes.
pub fn run_host(options: &HostOptions) -> Result<(), String> {
    let (cell_url, epoch) = assign(&options.director, &options.token, &options.relay_host_id)?;
    let mut control = connect(&format!("{cell_url}/v1/host/control"), Some(&options.token))?;
    send_json(
        &mut control,
        serde_json::json!({"type": "host-hello", "v": 1, "relayHostId": options.relay_host_id, "assignmentEpoch": epoch}),
    )?;
    send_json(
        &mut control,
        serde_json::json!({"type": "invite-create", "reqId": 1}),
    )?;
    let mut generation = 0u64;
    loop {
        let message = match control.read() {
            Ok(message) => message,
            Err(e) => return Err(format!("control socket closed: {e}")),
        };
        let text = match message {
            Message::Text(text) => text.to_string(),
            Message::Close(frame) => {
                let code = frame.map(|f| u16::from(f.code)).unwrap_or(1005);
                return Err(format!(
                    "control socket closed by the relay with code {code}"
                ));
            }
            _ => continue,
        };
        let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        match value["type"].as_str() {
            Some("host-hello-ack") => {
                generation = value["generation"].as_u64().unwrap_or(0);
                eprintln!("host: admitted at epoch {epoch}, generation {generation}");
            }
            Some("invite-created") => {
                let invite = value["inviteToken"].as_str().unwrap_or_default();
                println!(
                    "orca-relay client phone --cell {cell_url} --relay-host-id {} --invite {invite}",
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
            Some("drain") => eprintln!("host: relay is draining"),
            _ => {}
        }
    }
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
