//! The live handover's protocol (ARCHITECTURE.md "Live handover"): the messages between the
//! `handover` command, the running process and the next one, over [`wire`].
//!
//! Owns: the socket's path, the time limit, the message kinds and their JSON bodies, and the
//! transfer of a large document and many descriptors. The decisions (quiesce, commit,
//! rollback) live with the roles (`roles/handover.rs`); the command in `handover_command.rs`.
//!
//! Every message is one kind byte and a JSON body (or raw bytes for a document's chunks and the
//! byte buffers beside it, [`Kind::Raw`]); descriptors travel with [`Kind::Fds`] messages, at
//! most [`wire::MAX_FDS`] each, in the order the state document numbers them. A next process
//! that says it reads them ([`Ready::bytes_in_memfd`]) gets the document and the byte buffers
//! in one memfd instead ([`Kind::Bytes`], [`send_transfer`]); an older one, in chunks.

pub mod wire;

use std::os::fd::{OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use wire::{Channel, WireError};

use crate::clock;

/// From the moment the running process accepts a handover to the next process's confirmation
/// (SPEC §12): past it, the running process takes everything back.
pub const HANDOVER_TIMEOUT: Duration = Duration::from_secs(10);

/// A next process that has said nothing (no message, no [`Kind::Alive`], no byte of a
/// transfer taken) for this long after its `ready` is abandoned: the running process rolls
/// back at once, whatever is left of [`HANDOVER_TIMEOUT`] (issue 31).
pub const SILENCE: Duration = Duration::from_secs(2);

/// How often the next process says it is alive, from its `ready` to the outcome.
pub const BEAT: Duration = Duration::from_millis(250);

/// The file name of the running process's handover socket in `ORCA_RELAY_DATA_DIR`.
pub const SOCKET_NAME: &str = "handover.sock";

/// What the next process writes on the `handover` command's line once it has been committed
/// (the line is an inherited unix socket; its end without this word means the next process
/// ended without taking over).
pub const COMMITTED_WORD: &[u8] = b"committed\n";

/// Where a process whose data directory is `data_dir` listens for handovers.
pub fn socket_path(data_dir: &Path) -> PathBuf {
    data_dir.join(SOCKET_NAME)
}

/// The message kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// command → running: asks for a handover.
    Begin = 1,
    /// running → command: accepted, with the token the next process must present.
    Accepted = 2,
    /// running → command (or next): not now, with the cause.
    Refused = 3,
    /// command → running: the next process is gone before it confirmed.
    Abort = 4,
    /// running → command: how it ended.
    Outcome = 5,
    /// next → running: configuration read, store open, ready to receive.
    Ready = 6,
    /// next → running: cannot go on, with the cause.
    Failed = 7,
    /// running → next: the transfer's header.
    Transfer = 8,
    /// running → next: descriptors.
    Fds = 9,
    /// running → next: a chunk of the state document.
    Chunk = 10,
    /// running → next: the transfer is complete.
    End = 11,
    /// next → running: everything rebuilt, waiting behind the gate.
    Confirm = 12,
    /// running → next: the commit point. From here on the next process owns everything.
    Committed = 13,
    /// running → next: the handover failed; exit without touching anything.
    Rollback = 14,
    /// next → running: the cell and its connections are rebuilt; the spliced pairs can come
    /// (the running process parks its splice workers only now, so streams pause only for the
    /// pairs' part of the transfer).
    Built = 15,
    /// running → next: a chunk of the byte buffers beside a document (state version 3 on),
    /// after its last [`Kind::Chunk`].
    Raw = 16,
    /// running → next, after `ready`: what the running process holds ([`Prepare`]), for the
    /// next one to have its threads waiting before anything pauses.
    Prepare = 17,
    /// next → running: prepared; the running process may quiesce.
    Prepared = 18,
    /// next → running, every [`BEAT`] from `ready` to the outcome: alive ([`Alive`]). A next
    /// process silent for [`SILENCE`] is abandoned.
    Alive = 19,
    /// running → next, in a transfer whose header has [`Transfer::memfd_raw`]: one memfd
    /// holding the document and the first byte buffers, instead of their chunks.
    Bytes = 20,
}

impl Kind {
    pub fn from_u8(value: u8) -> Option<Kind> {
        use Kind::*;
        [
            Begin, Accepted, Refused, Abort, Outcome, Ready, Failed, Transfer, Fds, Chunk, End,
            Confirm, Committed, Rollback, Built, Raw, Prepare, Prepared, Alive, Bytes,
        ]
        .into_iter()
        .find(|kind| *kind as u8 == value)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Begin {
    pub pid: u32,
    pub version: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    pub token: String,
    pub pid: u32,
    pub version: String,
    /// What the running process is and listens on (absent from a build before issue 31): the
    /// command passes it to the next process (`--running`), which refuses, before it says
    /// `ready`, a configuration for another cell or a configured address the listeners are not
    /// bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<Running>,
}

/// The running process as the next one must match it: its role, its cell and its listeners.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Running {
    pub role: String,
    pub cell_id: String,
    pub listening: Listening,
    /// Its pid: until it exits its tasks share the machine's and the cgroup's counts with the
    /// next process, which plans its capacity without them (a fresh start's plan).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

impl Running {
    /// The form `--running` takes on the next process's command line.
    pub fn to_arg(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_arg(arg: &str) -> Result<Running, String> {
        serde_json::from_str(arg).map_err(|e| format!("a malformed --running: {e}"))
    }
}

/// The listeners a handover carries, as the running process holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Listening {
    pub ws: std::net::SocketAddr,
    pub http: std::net::SocketAddr,
    /// Held by systemd (the socket units' `ListenStream=`, passed at a start and carried by
    /// every handover since): the unit decides that address, not `ORCA_RELAY_WS_ADDR`, as at
    /// any start.
    #[serde(default)]
    pub ws_from_systemd: bool,
    #[serde(default)]
    pub http_from_systemd: bool,
}

/// A cause: why a step was refused or failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cause {
    #[serde(default)]
    pub token: Option<String>,
    pub cause: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    pub committed: bool,
    pub cause: Option<String>,
    pub new_pid: Option<u32>,
    pub new_version: Option<String>,
    /// Connections (controls, legs, connections still upgrading) and spliced pairs handed.
    pub connections: usize,
    pub pairs: usize,
    /// From quiesce to the commit: the longest any stream was paused.
    pub paused_ms: u64,
    /// From the begin to the commit (or the rollback).
    pub took_ms: u64,
}

/// running → next: the commit point's word.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Committed {
    /// A stop (SIGTERM) reached the running process after its commit decision: the next
    /// process begins its drain as soon as it serves. (Absent from an older build: false.)
    #[serde(default)]
    pub stop: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ready {
    pub token: String,
    pub pid: u32,
    pub version: String,
    /// The state versions this build reads.
    pub reads: Vec<u32>,
    /// This build reads a transfer's bytes from a memfd ([`Kind::Bytes`]). Absent from an
    /// older build: the bytes go in chunks.
    #[serde(default)]
    pub bytes_in_memfd: bool,
}

/// What the running process holds, told to the next one before anything pauses: it starts a
/// relay thread for each connection that will need one, waiting, so that none is started
/// while the connections are paused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Prepare {
    /// Connections on relay threads (controls, phones waiting for their data leg).
    pub threads: usize,
    /// Database connections the running process has open: the next one opens as many before
    /// it takes over, so that its first admissions do not wait for connects (and are not shed
    /// under pool pressure for it).
    #[serde(default)]
    pub pool_open: u32,
    /// The running process's highest descriptor number plus one: the next one grows its
    /// descriptor table to hold as many more before anything pauses. (Absent from an older
    /// build: 0, nothing grown.)
    #[serde(default)]
    pub descriptors: usize,
}

/// A next process's sign of life: when, on the machine's monotonic clock
/// (`clock::machine_ms`, the same in both processes), it was sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Alive {
    pub machine_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Transfer {
    /// The state document's version.
    pub version: u32,
    pub document_bytes: usize,
    pub fds: usize,
    /// The running process's `NOTIFY_SOCKET` and watchdog interval: the next process becomes
    /// the unit's main process, whatever environment the command gave it.
    pub notify_socket: Option<String>,
    pub watchdog_usec: Option<u64>,
    pub from_pid: u32,
    pub from_version: String,
    /// Since state version 3: the lengths of the byte buffers sent raw after the document
    /// ([`Kind::Raw`]), in its order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub raw: Vec<usize>,
    /// `Some(k)`: the document and the first `k` byte buffers come in one memfd
    /// ([`Kind::Bytes`], after the descriptors), the other buffers in chunks after it. `None`
    /// (and from an older build): the document in chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memfd_raw: Option<usize>,
}

/// The most of the byte buffers a transfer copies into its memfd ([`Transfer::memfd_raw`]);
/// the rest go in chunks (the copy is a second home for them while the transfer lasts).
pub const MEMFD_RAW_BYTES: usize = 64 << 20;

/// How many of `raw`'s buffers (from the first) fit in [`MEMFD_RAW_BYTES`].
pub fn raw_in_memfd(raw: &[usize]) -> usize {
    let mut total = 0usize;
    raw.iter()
        .take_while(|len| {
            total = total.saturating_add(**len);
            total <= MEMFD_RAW_BYTES
        })
        .count()
}

/// Why a receive failed: the transport, or a message that was not the one expected.
#[derive(Debug)]
pub enum ProtocolError {
    Wire(WireError),
    /// The other side answered with a failure or a refusal.
    Refused(String),
    Unexpected(&'static str),
}

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProtocolError::Wire(e) => write!(f, "{e}"),
            ProtocolError::Refused(cause) => f.write_str(cause),
            ProtocolError::Unexpected(what) => write!(f, "unexpected message: {what}"),
        }
    }
}

impl From<WireError> for ProtocolError {
    fn from(error: WireError) -> Self {
        ProtocolError::Wire(error)
    }
}

/// Sends one message with a JSON body.
pub fn send<T: Serialize>(
    channel: &Channel,
    kind: Kind,
    body: &T,
    deadline: Instant,
) -> Result<(), WireError> {
    let bytes = serde_json::to_vec(body).map_err(|_| WireError::Malformed("unserializable"))?;
    channel.send(kind as u8, &bytes, &[], deadline)
}

/// Receives one message and its kind (an unknown kind is malformed).
pub fn receive(channel: &Channel, deadline: Instant) -> Result<(Kind, wire::Message), WireError> {
    let message = channel.recv(deadline)?;
    let kind = Kind::from_u8(message.kind).ok_or(WireError::Malformed("unknown kind"))?;
    Ok((kind, message))
}

/// The JSON body of a message.
pub fn body<T: DeserializeOwned>(message: &wire::Message) -> Result<T, WireError> {
    serde_json::from_slice(&message.payload).map_err(|_| WireError::Malformed("bad body"))
}

/// Sends the descriptors in batches, then the document and the byte buffers beside it (their
/// lengths are `header.raw`): in one memfd when the header says so ([`Transfer::memfd_raw`]),
/// or in chunks; then `End`. Each message has until `step` from when it is begun (a receiver
/// that takes nothing for that long is not there), and the whole transfer until `deadline`.
///
/// The memfd is one copy and one message: in chunks, 1.7 MB of document for 2,000 connections
/// took 42–51 ms on two busy cores (a socket buffer's worth, then a wait for the other process
/// to be scheduled and read, thirty times over) while every control was paused; in a memfd, a
/// few.
pub fn send_transfer(
    channel: &Channel,
    header: &Transfer,
    document: &[u8],
    fds: &[RawFd],
    raw: &[Vec<u8>],
    (step, deadline): (Duration, Instant),
) -> Result<(), WireError> {
    let by = || (clock::instant() + step).min(deadline);
    send(channel, Kind::Transfer, header, by())?;
    for batch in fds.chunks(wire::MAX_FDS) {
        channel.send(Kind::Fds as u8, &[], batch, by())?;
    }
    let chunked = match header.memfd_raw {
        Some(in_memfd) => {
            let in_memfd = in_memfd.min(raw.len());
            let parts = std::iter::once(document).chain(raw[..in_memfd].iter().map(Vec::as_slice));
            let memfd = wire::memfd_with(parts).map_err(WireError::Io)?;
            channel.send(
                Kind::Bytes as u8,
                &[],
                &[std::os::fd::AsRawFd::as_raw_fd(&memfd)],
                by(),
            )?;
            &raw[in_memfd..]
        }
        None => {
            for chunk in document.chunks(wire::MAX_PAYLOAD) {
                channel.send(Kind::Chunk as u8, chunk, &[], by())?;
            }
            raw
        }
    };
    for buffer in chunked {
        for chunk in buffer.chunks(wire::MAX_PAYLOAD) {
            channel.send(Kind::Raw as u8, chunk, &[], by())?;
        }
    }
    channel.send(Kind::End as u8, &[], &[], by())
}

/// The most descriptors a transfer may announce: Linux's ceiling on a process's open files
/// (`fs.nr_open`, 1,048,576 by default); a header past it is refused before anything is
/// allocated for it.
pub const MAX_TRANSFER_FDS: usize = 1 << 20;

/// The most of an announced document allocated before its chunks arrive.
const PREALLOCATE_DOCUMENT: usize = 16 << 20;

/// What arrived: the header, the document, the descriptors in order, the byte buffers beside
/// the document in its order.
pub struct Received {
    pub header: Transfer,
    pub document: Vec<u8>,
    pub fds: Vec<OwnedFd>,
    pub raw: Vec<Vec<u8>>,
}

/// Receives a transfer (after its header). `on_fds` is told how many descriptors have arrived
/// after each batch (a test fault stops half-way). The document is bounded by its announced
/// size, itself bounded by `max_document`; each byte buffer beside it by `max_buffer`, and
/// given its memory only once its bytes begin to arrive.
pub fn receive_transfer(
    channel: &Channel,
    header: Transfer,
    (max_document, max_buffer): (usize, usize),
    deadline: Instant,
    mut on_fds: impl FnMut(usize),
) -> Result<Received, ProtocolError> {
    if header.document_bytes > max_document {
        return Err(ProtocolError::Unexpected("document too large"));
    }
    if header.fds > MAX_TRANSFER_FDS {
        return Err(ProtocolError::Unexpected(
            "more descriptors than a process holds",
        ));
    }
    if header.raw.iter().any(|len| *len > max_buffer) {
        return Err(ProtocolError::Unexpected("a byte buffer too large"));
    }
    // Memory grows with what arrives, not with what the header announces.
    let mut document = Vec::with_capacity(header.document_bytes.min(PREALLOCATE_DOCUMENT));
    let mut fds = Vec::with_capacity(header.fds);
    // The buffers in order; empty ones are complete at once.
    let mut raw: Vec<Vec<u8>> = Vec::new();
    let next_to_fill = |raw: &mut Vec<Vec<u8>>| {
        while raw.len() < header.raw.len() && header.raw[raw.len()] == 0 {
            raw.push(Vec::new());
        }
    };
    next_to_fill(&mut raw);
    // The memfd's part, when the header announces one: before it, no bytes may come.
    let mut memfd_due = header.memfd_raw.is_some();
    loop {
        let (kind, message) = receive(channel, deadline)?;
        match kind {
            Kind::Bytes if memfd_due => {
                memfd_due = false;
                let in_memfd = header.memfd_raw.unwrap_or(0);
                if in_memfd > header.raw.len() || message.fds.len() != 1 {
                    return Err(ProtocolError::Unexpected("a malformed memfd message"));
                }
                let mut lengths = vec![header.document_bytes];
                lengths.extend_from_slice(&header.raw[..in_memfd]);
                let mut parts = wire::read_memfd(&message.fds[0], &lengths)
                    .map_err(|_| ProtocolError::Unexpected("a memfd shorter than announced"))?
                    .into_iter();
                document = parts.next().unwrap_or_default();
                raw.clear();
                raw.extend(parts);
                next_to_fill(&mut raw);
            }
            Kind::Chunk | Kind::Raw | Kind::End if memfd_due => {
                return Err(ProtocolError::Unexpected(
                    "bytes before the announced memfd",
                ));
            }
            Kind::Raw => {
                // The buffer being filled: the last one begun, unless it is complete.
                let filling = raw
                    .last()
                    .is_some_and(|last| last.len() < header.raw[raw.len() - 1]);
                if !filling {
                    if raw.len() == header.raw.len() {
                        return Err(ProtocolError::Unexpected("more bytes than announced"));
                    }
                    raw.push(Vec::with_capacity(header.raw[raw.len()]));
                }
                let at = raw.len() - 1;
                let left = header.raw[at] - raw[at].len();
                if message.payload.len() > left {
                    return Err(ProtocolError::Unexpected(
                        "a byte buffer longer than announced",
                    ));
                }
                raw[at].extend_from_slice(&message.payload);
                if raw[at].len() == header.raw[at] {
                    next_to_fill(&mut raw);
                }
            }
            Kind::Fds => {
                fds.extend(message.fds);
                if fds.len() > header.fds {
                    return Err(ProtocolError::Unexpected("more descriptors than announced"));
                }
                on_fds(fds.len());
            }
            Kind::Chunk => {
                if document.len() + message.payload.len() > header.document_bytes {
                    return Err(ProtocolError::Unexpected(
                        "a longer document than announced",
                    ));
                }
                document.extend_from_slice(&message.payload);
            }
            Kind::End => break,
            Kind::Rollback => {
                let cause: Cause = body(&message)?;
                return Err(ProtocolError::Refused(cause.cause));
            }
            _ => return Err(ProtocolError::Unexpected("not part of a transfer")),
        }
    }
    let buffers_whole = raw.len() == header.raw.len()
        && raw
            .iter()
            .zip(&header.raw)
            .all(|(got, len)| got.len() == *len);
    if fds.len() != header.fds || document.len() != header.document_bytes || !buffers_whole {
        return Err(ProtocolError::Unexpected(
            "a transfer shorter than announced",
        ));
    }
    Ok(Received {
        header,
        document,
        fds,
        raw,
    })
}

/// A random one-time token (32 bytes, base64url).
pub fn token() -> Option<String> {
    use base64::Engine;
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).ok()?;
    Some(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// This build's version as the handover reports it: the package version, and a build note when
/// the binary carries one (see [`build_note`]).
pub fn version() -> String {
    match build_note() {
        Some(note) => format!("{}+{note}", env!("CARGO_PKG_VERSION")),
        None => env!("CARGO_PKG_VERSION").to_string(),
    }
}

/// A label a packager (or a test) writes into the built binary without rebuilding it: the
/// bytes after the marker, up to the first space. Blank in a plain build.
#[used]
static BUILD_NOTE: [u8; 64] = *b"ORCA_RELAY_BUILD_NOTE=                                          ";

/// The build note, if the binary carries one.
pub fn build_note() -> Option<String> {
    const MARKER: usize = "ORCA_RELAY_BUILD_NOTE=".len();
    // Read through a volatile load so that the compiler cannot fold the blank constant.
    let bytes: [u8; 64] =
        // SAFETY: a plain read of a static array of bytes.
        unsafe { std::ptr::read_volatile(&BUILD_NOTE) };
    let note: String = bytes[MARKER..]
        .iter()
        .take_while(|b| b.is_ascii_graphic())
        .map(|b| *b as char)
        .collect();
    (!note.is_empty()).then_some(note)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Instant {
        crate::clock::instant() + Duration::from_secs(5)
    }

    #[test]
    fn a_transfer_arrives_whole_with_its_descriptors_in_order() {
        transfer_arrives_whole(None);
    }

    /// The document and the first buffers in a memfd, the rest in chunks after it.
    #[test]
    fn a_transfer_through_a_memfd_arrives_whole_with_its_descriptors_in_order() {
        transfer_arrives_whole(Some(2));
        transfer_arrives_whole(Some(4));
        transfer_arrives_whole(Some(0));
    }

    fn transfer_arrives_whole(memfd_raw: Option<usize>) {
        let (a, b) = wire::pair().unwrap();
        let sockets: Vec<_> = (0..450)
            .map(|_| std::os::unix::net::UnixStream::pair().unwrap())
            .collect();
        let fds: Vec<RawFd> = sockets
            .iter()
            .map(|(left, _)| std::os::fd::AsRawFd::as_raw_fd(left))
            .collect();
        let document: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let header = Transfer {
            version: 1,
            document_bytes: document.len(),
            fds: fds.len(),
            notify_socket: None,
            watchdog_usec: None,
            from_pid: 1,
            from_version: version(),
            raw: vec![0, 70_000, 3, 0],
            memfd_raw,
        };
        let raw: Vec<Vec<u8>> = header
            .raw
            .iter()
            .enumerate()
            .map(|(i, len)| vec![i as u8; *len])
            .collect();
        let sender = {
            let document = document.clone();
            let header = header.clone();
            let raw = raw.clone();
            crate::threads::spawn("test-sender", move || {
                let limits = (Duration::from_secs(5), soon());
                send_transfer(&a, &header, &document, &fds, &raw, limits).unwrap();
                drop(sockets);
            })
            .unwrap()
        };
        let (kind, message) = receive(&b, soon()).unwrap();
        assert_eq!(kind, Kind::Transfer);
        let header: Transfer = body(&message).unwrap();
        let mut batches = Vec::new();
        let received =
            receive_transfer(&b, header, (1 << 20, 1 << 20), soon(), |n| batches.push(n)).unwrap();
        sender.join().unwrap();
        assert_eq!(received.document, document);
        assert_eq!(received.fds.len(), 450);
        assert_eq!(batches, vec![200, 400, 450]);
        assert_eq!(received.raw, raw, "the byte buffers, whole and in order");
    }

    /// The header comes from the other process: a count of descriptors no process could hold
    /// is refused, not allocated for (before: `Vec::with_capacity` panicked, "capacity
    /// overflow", or aborted the process on a count it could not allocate).
    #[test]
    fn a_header_announcing_more_descriptors_than_any_process_holds_is_refused() {
        let (a, b) = wire::pair().unwrap();
        a.send(Kind::End as u8, &[], &[], soon()).unwrap();
        let header = Transfer {
            version: 1,
            document_bytes: 0,
            fds: usize::MAX,
            notify_socket: None,
            watchdog_usec: None,
            from_pid: 1,
            from_version: version(),
            raw: Vec::new(),
            memfd_raw: None,
        };
        let result = receive_transfer(&b, header, (1 << 20, 1 << 20), soon(), |_| {});
        assert!(
            matches!(result, Err(ProtocolError::Unexpected(_))),
            "{:?}",
            result.err()
        );
    }

    /// A memfd that does not hold exactly the announced bytes (a longer one, a shorter one),
    /// or bytes in chunks where a memfd was announced, is refused: nothing is read past what
    /// the header announced.
    #[test]
    fn a_memfd_other_than_announced_is_refused() {
        let header = |document_bytes| Transfer {
            version: 1,
            document_bytes,
            fds: 0,
            notify_socket: None,
            watchdog_usec: None,
            from_pid: 1,
            from_version: version(),
            raw: vec![10],
            memfd_raw: Some(1),
        };
        for (announced, held) in [(100, 111), (100, 109)] {
            let (a, b) = wire::pair().unwrap();
            let bytes = vec![7u8; held];
            let memfd = wire::memfd_with(std::iter::once(bytes.as_slice())).unwrap();
            a.send(
                Kind::Bytes as u8,
                &[],
                &[std::os::fd::AsRawFd::as_raw_fd(&memfd)],
                soon(),
            )
            .unwrap();
            a.send(Kind::End as u8, &[], &[], soon()).unwrap();
            let result =
                receive_transfer(&b, header(announced), (1 << 20, 1 << 20), soon(), |_| {});
            assert!(
                matches!(result, Err(ProtocolError::Unexpected(_))),
                "{announced} announced, {held} held: {:?}",
                result.err()
            );
        }
        let (a, b) = wire::pair().unwrap();
        a.send(Kind::Chunk as u8, &[1; 100], &[], soon()).unwrap();
        let result = receive_transfer(&b, header(100), (1 << 20, 1 << 20), soon(), |_| {});
        assert!(matches!(result, Err(ProtocolError::Unexpected(_))));
    }

    #[test]
    fn a_plain_build_has_no_note() {
        assert_eq!(build_note(), None);
        assert_eq!(version(), env!("CARGO_PKG_VERSION"));
    }
}
