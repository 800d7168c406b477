//! `orca-relay fleet status [--director URL] [--json]`: the fleet as a director sees it, one
//! table row per cell and a summary line, read from the director's `GET /v1/admin/cells`
//! (`director::admin::fleet_listing`) with the service token.
//!
//! - The director: `--director URL`, else the first of `ORCA_RELAY_DIRECTOR_URLS`, else this
//!   machine's `ORCA_RELAY_HTTP_ADDR` when the configured role runs a director (`director`,
//!   `combined`). The token: the first of `ORCA_RELAY_SERVICE_TOKEN`, the next on a 401.
//! - Bounded: one deadline of [`DEADLINE`] for the whole exchange (connect, every token tried,
//!   the body), and at most [`MAX_LISTING_BYTES`] of body.
//! - Exit 0 when the fleet could be read; otherwise one line naming the cause (unreachable, no
//!   answer within the deadline, 401, another status, a bad answer), exit 1.
//! - `--json` prints the director's answer as it came (checked to be a version-1 listing
//!   first); the table is for people: aligned columns, states coloured only when stdout is a
//!   terminal and `NO_COLOR` is unset or empty (and `TERM` is not `dumb`).
//!
//! [`parse_listing`] and [`render`] are pure and unit-tested; [`run`] is the HTTP shell.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use serde_json::Value;

use crate::config::{Config, Role};
use crate::director::admin::CELLS_PATH;
use crate::service_token::ServiceTokens;

/// The whole exchange with the director, every token tried and the body read, within this.
pub const DEADLINE: Duration = Duration::from_secs(10);
/// The largest listing read. A cell's entry is about 1.5 KiB, so this holds thousands of cells;
/// past it the answer is refused as bad rather than read without end.
pub const MAX_LISTING_BYTES: u64 = 8 * 1024 * 1024;
/// Longest text shown in one table cell (a region is a free label).
const MAX_SHOWN_CHARS: usize = 48;

/// What the operator asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetStatusOptions {
    pub director: Option<String>,
    pub json: bool,
}

impl FleetStatusOptions {
    /// Parses the words after `fleet`: `status [--director URL] [--json]`.
    pub fn parse(words: &[String]) -> Result<FleetStatusOptions, String> {
        let usage = "usage: orca-relay fleet status [--director URL] [--json]";
        let mut words = words.iter();
        if words.next().map(String::as_str) != Some("status") {
            return Err(usage.into());
        }
        let mut options = FleetStatusOptions {
            director: None,
            json: false,
        };
        while let Some(word) = words.next() {
            match word.as_str() {
                "--json" => options.json = true,
                "--director" => {
                    let url = words.next().ok_or("--director needs a value")?;
                    if !(url.starts_with("http://") || url.starts_with("https://")) {
                        return Err(format!(
                            "--director {url:?}: expected an http:// or https:// URL"
                        ));
                    }
                    options.director = Some(url.trim_end_matches('/').to_string());
                }
                other => {
                    return Err(format!(
                        "fleet status: unexpected argument {other:?}; {usage}"
                    ))
                }
            }
        }
        Ok(options)
    }
}

/// The director to ask when `--director` is not given.
pub fn default_director(config: &Config) -> Result<String, String> {
    if let Some(first) = config.director_urls.first() {
        return Ok(first.trim_end_matches('/').to_string());
    }
    match config.role {
        Role::Director | Role::Combined => Ok(local_http_base(config.http_addr)),
        Role::Cell => Err(
            "fleet status: no director to ask: give --director URL (ORCA_RELAY_DIRECTOR_URLS is unset)"
                .into(),
        ),
    }
}

/// `http://<addr>`, an unspecified address (`0.0.0.0`, `::`) replaced by loopback.
fn local_http_base(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

/// Whether to colour the table: stdout is a terminal, `NO_COLOR` is unset or empty
/// (no-color.org), and `TERM` is not `dumb`.
pub fn use_colour(stdout_is_terminal: bool, no_color: Option<&str>, term: Option<&str>) -> bool {
    stdout_is_terminal && no_color.is_none_or(str::is_empty) && term != Some("dumb")
}

/// Runs the command: reads the listing and writes the table (or the JSON) to `out`. The error
/// is the one line to print.
pub fn run(
    config: &Config,
    options: &FleetStatusOptions,
    colour: bool,
    out: &mut dyn Write,
) -> Result<(), String> {
    let director = match &options.director {
        Some(url) => url.clone(),
        None => default_director(config)?,
    };
    let Some(tokens) = config.service_token.clone() else {
        return Err(match (config.role, &options.director) {
            (Role::Combined, None) => "fleet status: ORCA_RELAY_SERVICE_TOKEN is not set: the combined role serves its fleet listing only with a configured service token; set the same ORCA_RELAY_SERVICE_TOKEN for the relay and for this command".into(),
            _ => "fleet status: ORCA_RELAY_SERVICE_TOKEN is not set: the director's admin API needs the fleet's service token".into(),
        });
    };
    let body = fetch(&director, &tokens)?;
    let listing: Value = serde_json::from_slice(&body).map_err(|e| {
        format!("fleet status: bad answer from the director at {director}: not JSON ({e})")
    })?;
    let (rows, summary) = parse_listing(&listing)
        .map_err(|e| format!("fleet status: bad answer from the director at {director}: {e}"))?;
    let written = if options.json {
        out.write_all(&body).and_then(|()| {
            if body.last() == Some(&b'\n') {
                Ok(())
            } else {
                out.write_all(b"\n")
            }
        })
    } else {
        out.write_all(render(&rows, summary.as_ref(), colour).as_bytes())
    };
    written.map_err(|e| format!("fleet status: cannot write the output: {e}"))
}

/// `GET <director>/v1/admin/cells` with the service token, the whole exchange within
/// [`DEADLINE`], the body within [`MAX_LISTING_BYTES`].
fn fetch(director: &str, tokens: &ServiceTokens) -> Result<Vec<u8>, String> {
    let url = format!("{director}{CELLS_PATH}");
    let deadline = crate::clock::instant() + DEADLINE;
    let left = || {
        deadline
            .saturating_duration_since(crate::clock::instant())
            .max(Duration::from_millis(1))
    };
    let agent = ureq::AgentBuilder::new().build();
    let answer = tokens
        .call_http(director, left(), |token, time_left| {
            agent
                .get(&url)
                .timeout(time_left)
                .set("Authorization", &format!("Bearer {token}"))
                .call()
                .map_err(Box::new)
        })
        .map_err(|error| *error);
    let no_answer = || {
        format!(
            "fleet status: no answer from the director at {director} within {} s",
            DEADLINE.as_secs()
        )
    };
    let response = match answer {
        Ok(response) => response,
        Err(ureq::Error::Status(status, response)) => {
            let code = error_code(response);
            return Err(match (status, code.as_deref()) {
                (401, Some("service_token_not_configured")) => format!(
                    "fleet status: the combined relay at {director} serves the fleet listing only when ORCA_RELAY_SERVICE_TOKEN is set: set the same token for the relay and for this command (401)"
                ),
                (401, _) => format!(
                    "fleet status: the director at {director} refused the service token (401 unauthorized): check ORCA_RELAY_SERVICE_TOKEN"
                ),
                (status, Some(code)) => {
                    format!("fleet status: the director at {director} answered {status} {code}")
                }
                (status, None) => {
                    format!("fleet status: the director at {director} answered {status}")
                }
            });
        }
        Err(ureq::Error::Transport(transport)) => {
            return Err(if crate::outbound::is_timeout(&transport) {
                no_answer()
            } else {
                one_line(&format!(
                    "fleet status: director unreachable at {director}: {}",
                    transport_cause(&transport)
                ))
            })
        }
    };
    let mut body = Vec::new();
    response
        .into_reader()
        .take(MAX_LISTING_BYTES + 1)
        .read_to_end(&mut body)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => no_answer(),
            _ => one_line(&format!(
                "fleet status: bad answer from the director at {director}: the body could not be read ({e})"
            )),
        })?;
    if body.len() as u64 > MAX_LISTING_BYTES {
        return Err(format!(
            "fleet status: bad answer from the director at {director}: the body exceeds {MAX_LISTING_BYTES} bytes"
        ));
    }
    Ok(body)
}

/// The `error` code of an error answer's JSON body (read with a small bound), if any.
fn error_code(response: ureq::Response) -> Option<String> {
    let mut body = Vec::new();
    response
        .into_reader()
        .take(4 * 1024)
        .read_to_end(&mut body)
        .ok()?;
    let value: Value = serde_json::from_slice(&body).ok()?;
    value
        .get("error")
        .and_then(Value::as_str)
        .map(|code| shown(code, MAX_SHOWN_CHARS))
}

/// The transport failure without the URL ureq puts in front (the line names the director).
fn transport_cause(transport: &ureq::Transport) -> String {
    let kind = transport.kind().to_string();
    match transport.message() {
        Some(message) => format!("{kind}: {message}"),
        None => {
            use std::error::Error;
            match transport.source() {
                Some(source) => format!("{kind}: {source}"),
                None => kind,
            }
        }
    }
}

fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// Text from the network made safe for a terminal: control characters replaced, at most
/// `max` characters.
fn shown(text: &str, max: usize) -> String {
    let mut shown: String = text
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .take(max)
        .collect();
    if text.chars().count() > max {
        shown.push('…');
    }
    shown
}

/// A cell's membership and readiness, as the STATE column shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CellState {
    Ready,
    NotReady,
    /// Live, readiness not known (no heartbeat yet).
    Live,
    Draining,
    Retired,
    /// A state a newer director names.
    Other(String),
}

impl CellState {
    fn text(&self) -> &str {
        match self {
            CellState::Ready => "ready",
            CellState::NotReady => "not ready",
            CellState::Live => "live",
            CellState::Draining => "draining",
            CellState::Retired => "retired",
            CellState::Other(text) => text,
        }
    }

    fn colour(&self) -> Option<&'static str> {
        match self {
            CellState::Ready => Some(GREEN),
            CellState::NotReady => Some(RED),
            CellState::Draining => Some(YELLOW),
            CellState::Retired => Some(DIM),
            CellState::Live | CellState::Other(_) => None,
        }
    }
}

/// The `deadManTripSlots` in force on a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TripSlots {
    /// The cell sent no report.
    Unknown,
    NoCap,
    Cap(u64),
}

/// One table row; `None` is a fact the director did not have (shown as `-`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub cell_id: String,
    pub region: String,
    pub state: CellState,
    /// Raw and effective admission mode.
    pub admit: Option<(String, String)>,
    pub dead_man: Option<String>,
    pub window_left_ms: Option<u64>,
    /// Holds a trip slot, as the claim counts it.
    pub holds_slot: Option<bool>,
    pub trip_slots: TripSlots,
    pub heartbeat_age_ms: Option<u64>,
    /// Connections and, when the cell reported it, the cap.
    pub connections: Option<(u64, Option<u64>)>,
    /// Database connections in use and the ceiling in force.
    pub pool: Option<(u64, u64)>,
}

/// The listing's `summary`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    pub cells: u64,
    pub live: u64,
    pub ready: u64,
    pub draining: u64,
    pub retired: u64,
    pub armed: u64,
    pub held: u64,
    pub tripped: u64,
    pub off: u64,
    pub unknown: u64,
    pub slots_taken: u64,
    /// `None`: no cell has a cap.
    pub slots: Option<u64>,
}

/// Reads a version-1 listing into rows and its summary (`None` from a director that sends
/// none). Missing facts become `None`; only a listing that is not one is an error.
pub fn parse_listing(listing: &Value) -> Result<(Vec<Row>, Option<Summary>), String> {
    if listing.get("v").and_then(Value::as_u64) != Some(1) {
        return Err("not a version 1 cell listing (\"v\" is not 1)".into());
    }
    let cells = listing
        .get("cells")
        .and_then(Value::as_array)
        .ok_or("not a cell listing (no \"cells\" array)")?;
    let rows = cells.iter().map(row).collect();
    let summary = listing.get("summary").filter(|s| s.is_object()).map(|s| {
        let n = |path: &[&str]| {
            path.iter()
                .try_fold(s, |value, key| value.get(key))
                .and_then(Value::as_u64)
                .unwrap_or(0)
        };
        Summary {
            cells: n(&["cells"]),
            live: n(&["byState", "live"]),
            ready: n(&["ready"]),
            draining: n(&["byState", "draining"]),
            retired: n(&["byState", "retired"]),
            armed: n(&["byDeadMan", "armed"]),
            held: n(&["byDeadMan", "held"]),
            tripped: n(&["byDeadMan", "tripped"]),
            off: n(&["byDeadMan", "off"]),
            unknown: n(&["byDeadMan", "unknown"]),
            slots_taken: n(&["slotsTaken"]),
            slots: s.get("slots").and_then(Value::as_u64),
        }
    });
    Ok((rows, summary))
}

fn row(cell: &Value) -> Row {
    let text = |value: Option<&Value>| {
        value
            .and_then(Value::as_str)
            .map(|t| shown(t, MAX_SHOWN_CHARS))
    };
    let status = cell.get("status").filter(|s| s.is_object());
    let at = |path: &[&str]| path.iter().try_fold(cell, |value, key| value.get(key));
    let state = match text(cell.get("state")).as_deref() {
        Some("live") => match cell.get("ready").and_then(Value::as_bool) {
            Some(true) => CellState::Ready,
            Some(false) => CellState::NotReady,
            None => CellState::Live,
        },
        Some("draining") => CellState::Draining,
        Some("retired") => CellState::Retired,
        Some(other) => CellState::Other(other.to_string()),
        None => CellState::Other("-".into()),
    };
    let nonempty = |value: Option<String>| value.filter(|t| !t.is_empty());
    // Admission modes: the cell's report, else what the feed poller last saw.
    let admit = status
        .and_then(|s| {
            Some((
                nonempty(text(s.get("admitModeRaw")))?,
                nonempty(text(s.get("admitModeEffective")))?,
            ))
        })
        .or_else(|| {
            Some((
                text(at(&["feed", "admitModeRaw"]))?,
                text(at(&["feed", "admitModeEffective"]))?,
            ))
        });
    let trip_slots = match status {
        None => TripSlots::Unknown,
        Some(s) => match s.get("tripSlots").and_then(Value::as_u64) {
            Some(n) => TripSlots::Cap(n),
            None => TripSlots::NoCap,
        },
    };
    let connections = match status {
        Some(s) => s
            .get("connections")
            .and_then(Value::as_u64)
            .map(|n| (n, s.get("connectionCap").and_then(Value::as_u64))),
        None => at(&["heartbeat", "connections"])
            .and_then(Value::as_u64)
            .map(|n| (n, None)),
    };
    Row {
        cell_id: text(cell.get("cellId")).unwrap_or_else(|| "-".into()),
        region: text(cell.get("region")).unwrap_or_else(|| "-".into()),
        state,
        admit,
        dead_man: status.and_then(|s| text(s.get("deadMan"))),
        window_left_ms: status
            .and_then(|s| s.get("windowLeftMs"))
            .and_then(Value::as_u64),
        holds_slot: cell.get("holdsTripSlot").and_then(Value::as_bool),
        trip_slots,
        heartbeat_age_ms: at(&["heartbeat", "ageMs"])
            .and_then(Value::as_i64)
            .map(|a| a.max(0) as u64),
        connections,
        pool: status.and_then(|s| {
            Some((
                s.get("pool")?.get("inUse")?.as_u64()?,
                s.get("pool")?.get("ceiling")?.as_u64()?,
            ))
        }),
    }
}

const GREEN: &str = "\x1b[32m";
const YELLOW: &str = "\x1b[33m";
const RED: &str = "\x1b[31m";
const BOLD: &str = "\x1b[1m";
const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

fn dead_man_colour(state: &str) -> Option<&'static str> {
    match state {
        "armed" => Some(GREEN),
        "held" => Some(YELLOW),
        "tripped" => Some(RED),
        _ => None,
    }
}

/// A duration for people: `0s`, `850ms`, `12.3s`, `4m05s`, `2h07m`.
pub fn duration(ms: u64) -> String {
    if ms == 0 {
        "0s".into()
    } else if ms < 1_000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{}.{}s", ms / 1_000, ms % 1_000 / 100)
    } else if ms < 3_600_000 {
        format!("{}m{:02}s", ms / 60_000, ms % 60_000 / 1_000)
    } else {
        format!("{}h{:02}m", ms / 3_600_000, ms % 3_600_000 / 60_000)
    }
}

const HEADER: [&str; 11] = [
    "CELL",
    "REGION",
    "STATE",
    "ADMIT RAW/EFF",
    "DEAD-MAN",
    "WINDOW LEFT",
    "SLOT",
    "TRIP SLOTS",
    "HEARTBEAT",
    "CONNS/CAP",
    "DB POOL",
];

/// One table cell: its text and, when coloured, its colour.
struct Cell {
    text: String,
    colour: Option<&'static str>,
}

fn plain(text: impl Into<String>) -> Cell {
    Cell {
        text: text.into(),
        colour: None,
    }
}

fn cells_of(row: &Row) -> [Cell; 11] {
    let dash = || "-".to_string();
    [
        plain(row.cell_id.clone()),
        plain(row.region.clone()),
        Cell {
            text: row.state.text().to_string(),
            colour: row.state.colour(),
        },
        plain(
            row.admit
                .as_ref()
                .map_or_else(dash, |(raw, effective)| format!("{raw}/{effective}")),
        ),
        Cell {
            text: row.dead_man.clone().unwrap_or_else(dash),
            colour: row.dead_man.as_deref().and_then(dead_man_colour),
        },
        plain(row.window_left_ms.map_or_else(dash, duration)),
        Cell {
            text: match row.holds_slot {
                Some(true) => "yes".into(),
                Some(false) => "no".into(),
                None => dash(),
            },
            colour: (row.holds_slot == Some(true)).then_some(BOLD),
        },
        plain(match row.trip_slots {
            TripSlots::Unknown => dash(),
            TripSlots::NoCap => "none".into(),
            TripSlots::Cap(n) => n.to_string(),
        }),
        plain(row.heartbeat_age_ms.map_or_else(dash, duration)),
        plain(match row.connections {
            Some((n, Some(cap))) => format!("{n}/{cap}"),
            Some((n, None)) => format!("{n}/-"),
            None => dash(),
        }),
        plain(
            row.pool
                .map_or_else(dash, |(in_use, ceiling)| format!("{in_use}/{ceiling}")),
        ),
    ]
}

/// The summary line: cells by state, dead-man states, slots taken of the fleet's slots.
pub fn summary_line(summary: Option<&Summary>) -> String {
    let Some(s) = summary else {
        return "summary: not given by this director (an older version)".into();
    };
    let slots = match s.slots {
        Some(slots) => slots.to_string(),
        None => "no cap".into(),
    };
    format!(
        "{} cells: {} live ({} ready), {} draining, {} retired; dead-man: {} armed, {} held, {} tripped, {} off, {} unknown; trip slots taken {}/{}",
        s.cells,
        s.live,
        s.ready,
        s.draining,
        s.retired,
        s.armed,
        s.held,
        s.tripped,
        s.off,
        s.unknown,
        s.slots_taken,
        slots
    )
}

/// The table: a header, one row per cell, columns aligned on their widest text (colour codes
/// wrap the text and never count), two spaces apart; then the summary line.
pub fn render(rows: &[Row], summary: Option<&Summary>, colour: bool) -> String {
    let table: Vec<[Cell; 11]> = rows.iter().map(cells_of).collect();
    let mut widths = HEADER.map(|title| title.chars().count());
    for cells in &table {
        for (width, cell) in widths.iter_mut().zip(cells.iter()) {
            *width = (*width).max(cell.text.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[Cell]| {
        let mut text = String::new();
        for (index, (cell, width)) in cells.iter().zip(widths.iter()).enumerate() {
            if index > 0 {
                text.push_str("  ");
            }
            match cell.colour.filter(|_| colour) {
                Some(code) => {
                    text.push_str(code);
                    text.push_str(&cell.text);
                    text.push_str(RESET);
                }
                None => text.push_str(&cell.text),
            }
            let pad = width.saturating_sub(cell.text.chars().count());
            text.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&HEADER.map(plain));
    for cells in &table {
        line(cells);
    }
    out.push_str(&summary_line(summary));
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn options_parse_and_refuse_what_they_do_not_know() {
        assert_eq!(
            FleetStatusOptions::parse(&args(&["status"])),
            Ok(FleetStatusOptions {
                director: None,
                json: false
            })
        );
        assert_eq!(
            FleetStatusOptions::parse(&args(&["status", "--json", "--director", "http://d:8081/"])),
            Ok(FleetStatusOptions {
                director: Some("http://d:8081".into()),
                json: true
            })
        );
        assert!(FleetStatusOptions::parse(&args(&[])).is_err());
        assert!(FleetStatusOptions::parse(&args(&["stats"])).is_err());
        assert!(FleetStatusOptions::parse(&args(&["status", "--director"])).is_err());
        assert!(FleetStatusOptions::parse(&args(&["status", "--director", "d:8081"])).is_err());
        assert!(FleetStatusOptions::parse(&args(&["status", "--verbose"])).is_err());
    }

    #[test]
    fn the_director_defaults_to_the_first_membership_then_the_local_director() {
        let config = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Config::from_lookup_all(&|name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            })
            .expect("a valid config")
        };
        let combined = config(&[("ORCA_RELAY_HTTP_ADDR", "0.0.0.0:9081")]);
        assert_eq!(
            default_director(&combined).unwrap(),
            "http://127.0.0.1:9081"
        );
        let director = config(&[
            ("ORCA_RELAY_ROLE", "director"),
            ("ORCA_RELAY_SERVICE_TOKEN", "t"),
            ("ORCA_RELAY_JWKS_URL", "https://auth/jwks.json"),
            ("ORCA_RELAY_AUTH_ISSUER", "https://auth"),
            ("ORCA_RELAY_HTTP_ADDR", "10.0.0.5:8081"),
        ]);
        assert_eq!(default_director(&director).unwrap(), "http://10.0.0.5:8081");
        let cell = config(&[
            ("ORCA_RELAY_ROLE", "cell"),
            ("ORCA_RELAY_SERVICE_TOKEN", "t"),
            ("ORCA_RELAY_JWKS_URL", "https://auth/jwks.json"),
            ("ORCA_RELAY_AUTH_ISSUER", "https://auth"),
            ("ORCA_RELAY_DIRECTOR_URLS", "http://d1:8081/,http://d2:8081"),
        ]);
        assert_eq!(default_director(&cell).unwrap(), "http://d1:8081");
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None, Some("xterm-256color")));
        assert!(
            use_colour(true, Some(""), None),
            "an empty NO_COLOR is unset"
        );
        assert!(!use_colour(true, Some("1"), None));
        assert!(!use_colour(false, None, None), "piped");
        assert!(!use_colour(true, None, Some("dumb")));
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(duration(0), "0s");
        assert_eq!(duration(850), "850ms");
        assert_eq!(duration(12_345), "12.3s");
        assert_eq!(duration(245_000), "4m05s");
        assert_eq!(duration(7_620_000), "2h07m");
    }

    fn listing() -> Value {
        json!({
            "v": 1,
            "director": {"uptimeMs": 1},
            "cells": [
                {"cellId": "a", "state": "live", "ready": true, "region": "eu",
                 "heartbeat": {"ageMs": 200, "connections": 3},
                 "holdsTripSlot": false,
                 "status": {"admitModeRaw": "reserve", "admitModeEffective": "reserve",
                            "deadMan": "armed", "windowMs": 60_000, "windowLeftMs": 57_300,
                            "tripSlots": 2, "connections": 3, "connectionCap": 1000,
                            "pool": {"inUse": 1, "ceiling": 4}, "ready": true,
                            "source": "feed", "ageMs": 100}},
                {"cellId": "a-much-longer-cell-id-from-autoscaling-0042", "state": "live",
                 "ready": true, "region": "ap-southeast",
                 "heartbeat": {"ageMs": 150, "connections": 0},
                 "holdsTripSlot": true,
                 "status": {"admitModeRaw": "db", "admitModeEffective": "db",
                            "deadMan": "tripped", "windowLeftMs": 0, "tripSlots": null,
                            "connections": 12, "connectionCap": 1000,
                            "pool": {"inUse": 10, "ceiling": 10}}},
                {"cellId": "old", "state": "draining", "ready": false, "region": "eu",
                 "heartbeat": null, "holdsTripSlot": false, "status": null,
                 "feed": {"admitModeRaw": "db", "admitModeEffective": "db"}},
                {"cellId": "gone", "state": "retired", "ready": null, "region": "eu\u{1b}[31m",
                 "heartbeat": {"ageMs": 700_000, "connections": 1}}
            ],
            "summary": {"cells": 4, "byState": {"live": 2, "draining": 1, "retired": 1},
                        "ready": 2,
                        "byDeadMan": {"off": 0, "armed": 1, "held": 0, "tripped": 1, "unknown": 1},
                        "slotsTaken": 1, "slots": 2}
        })
    }

    #[test]
    fn missing_facts_are_dashes_and_terminal_escapes_are_not_passed_on() {
        let (rows, summary) = parse_listing(&listing()).unwrap();
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[1].trip_slots, TripSlots::NoCap);
        assert_eq!(rows[2].trip_slots, TripSlots::Unknown);
        assert_eq!(
            rows[2].admit,
            Some(("db".into(), "db".into())),
            "no report: what the feed poller saw"
        );
        assert_eq!(rows[3].region, "eu?[31m");
        let table = render(&rows, summary.as_ref(), false);
        assert!(!table.contains('\u{1b}'), "{table}");
        let old = table.lines().find(|l| l.starts_with("old ")).unwrap();
        let fields: Vec<&str> = old.split_whitespace().collect();
        assert_eq!(
            fields,
            ["old", "eu", "draining", "db/db", "-", "-", "no", "-", "-", "-", "-"]
        );
        let gone = table.lines().find(|l| l.starts_with("gone ")).unwrap();
        assert!(gone.contains("11m40s"), "{gone}");
        assert!(
            gone.contains("1/-"),
            "the heartbeat's count, cap unknown: {gone}"
        );
    }

    #[test]
    fn columns_stay_aligned_around_a_long_id() {
        let (rows, summary) = parse_listing(&listing()).unwrap();
        let table = render(&rows, summary.as_ref(), false);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 6, "header, four cells, summary:\n{table}");
        assert_eq!(
            lines[0].find("REGION"),
            Some("a-much-longer-cell-id-from-autoscaling-0042".len() + 2),
            "the widest id sets the first column:\n{table}"
        );
        // Every column starts at the header's offset on every row.
        let value_at = |line: &str, column: &str| -> String {
            let at = lines[0].find(column).unwrap();
            assert!(
                at == 0 || line[..at].ends_with("  "),
                "{column} does not start a column in {line:?}"
            );
            line[at..].split("  ").next().unwrap().to_string()
        };
        let expected = [
            (
                "CELL",
                [
                    "a",
                    "a-much-longer-cell-id-from-autoscaling-0042",
                    "old",
                    "gone",
                ],
            ),
            ("REGION", ["eu", "ap-southeast", "eu", "eu?[31m"]),
            ("STATE", ["ready", "ready", "draining", "retired"]),
            ("ADMIT RAW/EFF", ["reserve/reserve", "db/db", "db/db", "-"]),
            ("DEAD-MAN", ["armed", "tripped", "-", "-"]),
            ("WINDOW LEFT", ["57.3s", "0s", "-", "-"]),
            ("SLOT", ["no", "yes", "no", "-"]),
            ("TRIP SLOTS", ["2", "none", "-", "-"]),
            ("HEARTBEAT", ["200ms", "150ms", "-", "11m40s"]),
            ("CONNS/CAP", ["3/1000", "12/1000", "-", "1/-"]),
            ("DB POOL", ["1/4", "10/10", "-", "-"]),
        ];
        for (column, values) in expected {
            for (line, value) in lines[1..5].iter().zip(values) {
                assert_eq!(
                    value_at(line, column).trim_end(),
                    value,
                    "{column}:\n{table}"
                );
            }
        }
        assert_eq!(
            lines[5],
            "4 cells: 2 live (2 ready), 1 draining, 1 retired; dead-man: 1 armed, 0 held, 1 tripped, 0 off, 1 unknown; trip slots taken 1/2"
        );
        assert!(lines.iter().all(|line| line == &line.trim_end()));
    }

    #[test]
    fn colour_wraps_the_states_without_moving_the_columns() {
        let (rows, summary) = parse_listing(&listing()).unwrap();
        let plain_table = render(&rows, summary.as_ref(), false);
        let coloured = render(&rows, summary.as_ref(), true);
        assert!(coloured.contains("\x1b[32marmed\x1b[0m"), "{coloured}");
        assert!(coloured.contains("\x1b[31mtripped\x1b[0m"));
        assert!(coloured.contains("\x1b[33mdraining\x1b[0m"));
        assert!(coloured.contains("\x1b[32mready\x1b[0m"));
        assert!(coloured.contains("\x1b[1myes\x1b[0m"));
        let stripped = coloured
            .replace(GREEN, "")
            .replace(YELLOW, "")
            .replace(RED, "")
            .replace(BOLD, "")
            .replace(DIM, "")
            .replace(RESET, "");
        assert_eq!(stripped, plain_table);
    }

    #[test]
    fn a_listing_from_an_older_director_still_renders_and_a_non_listing_is_refused() {
        let older = json!({"v": 1, "cells": [{"cellId": "a", "state": "live", "ready": true,
                                             "region": "eu"}]});
        let (rows, summary) = parse_listing(&older).unwrap();
        assert_eq!(summary, None);
        let table = render(&rows, None, false);
        assert!(table.ends_with("summary: not given by this director (an older version)\n"));
        assert_eq!(rows[0].holds_slot, None);
        assert!(parse_listing(&json!({"v": 2, "cells": []})).is_err());
        assert!(parse_listing(&json!({"v": 1})).is_err());
        assert!(parse_listing(&json!([1, 2])).is_err());
        let empty = parse_listing(&json!({"v": 1, "cells": [], "summary": {"cells": 0}})).unwrap();
        assert_eq!(empty.0, Vec::new());
        assert_eq!(
            summary_line(empty.1.as_ref()),
            "0 cells: 0 live (0 ready), 0 draining, 0 retired; dead-man: 0 armed, 0 held, 0 tripped, 0 off, 0 unknown; trip slots taken 0/no cap"
        );
    }
}
