//! Handovers across state versions: a running process's state, as one build wrote it, kept in
//! `tests/fixtures/handover/v<N>/` and handed to the build under test.
//!
//! [`capture`] plays the `handover` command and the next process against a real running relay
//! (the library's protocol functions, in this test process): it keeps the two documents the
//! relay sends, exactly as sent, then fails the handover so the relay rolls back. [`Giver`]
//! plays a running process that wrote such documents: it listens where a next process looks,
//! sends the kept documents with descriptors of its own (listeners, and one end of a fresh TCP
//! connection for each carried connection, whose other end the test holds), and commits.
//!
//! What a document carries of the clients it had (tokens, tickets, the bytes a client sent
//! halfway) is in `notes.json` beside it, written by the test that captured it.

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use orca_relay::handover::wire::{self, Channel};
use orca_relay::handover::{
    self as protocol, body, receive, send, Accepted, Begin, Cause, Kind, Ready, Transfer,
};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(20);

fn deadline() -> std::time::Instant {
    orca_relay::clock::instant() + WAIT
}

/// Where the fixtures of state `version` live.
pub fn dir(version: u32) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/handover")
        .join(format!("v{version}"))
}

/// The two documents a running process sent, as it sent them, with the byte buffers that came
/// beside each (state version 3 on; none before).
pub struct Captured {
    pub cell: Vec<u8>,
    pub pairs: Vec<u8>,
    pub cell_raw: Vec<Vec<u8>>,
    pub pairs_raw: Vec<Vec<u8>>,
}

/// Asks the relay whose data directory is `data_dir` for a handover, takes its two documents
/// as the next process would, then fails it (the relay rolls back and keeps serving).
pub fn capture(data_dir: &Path) -> Result<Captured, String> {
    let socket = protocol::socket_path(data_dir);
    let command = Channel::connect(&socket, deadline()).map_err(|e| format!("connect: {e}"))?;
    let begin = Begin {
        pid: std::process::id(),
        version: "capture".into(),
    };
    send(&command, Kind::Begin, &begin, deadline()).map_err(|e| e.to_string())?;
    let accepted: Accepted = match receive(&command, deadline()) {
        Ok((Kind::Accepted, message)) => body(&message).map_err(|e| e.to_string())?,
        other => return Err(format!("not accepted: {other:?}")),
    };
    let next = Channel::connect(&socket, deadline()).map_err(|e| format!("connect: {e}"))?;
    let ready = Ready {
        token: accepted.token.clone(),
        pid: std::process::id(),
        version: "capture".into(),
        reads: orca_relay::carry::READS.to_vec(),
        // As a build before memfd transfers: the running process sends in chunks.
        bytes_in_memfd: false,
    };
    send(&next, Kind::Ready, &ready, deadline()).map_err(|e| e.to_string())?;
    let part = |channel: &Channel| -> Result<(Vec<u8>, Vec<Vec<u8>>), String> {
        let header: Transfer = loop {
            match receive(channel, deadline()) {
                Ok((Kind::Transfer, message)) => {
                    break body(&message).map_err(|e| e.to_string())?
                }
                // A running process of this build first says what it holds.
                Ok((Kind::Prepare, _)) => {
                    send(channel, Kind::Prepared, &serde_json::json!({}), deadline())
                        .map_err(|e| e.to_string())?
                }
                other => return Err(format!("no transfer: {other:?}")),
            }
        };
        let received =
            protocol::receive_transfer(channel, header, (1 << 30, 1 << 24), deadline(), |_| {})
                .map_err(|e| e.to_string())?;
        Ok((received.document, received.raw))
    };
    let (cell, cell_raw) = part(&next)?;
    send(&next, Kind::Built, &serde_json::json!({}), deadline()).map_err(|e| e.to_string())?;
    let (pairs, pairs_raw) = part(&next)?;
    let failed = Cause {
        token: Some(accepted.token),
        cause: "captured for a fixture".into(),
    };
    send(&next, Kind::Failed, &failed, deadline()).map_err(|e| e.to_string())?;
    match receive(&command, deadline()) {
        Ok((Kind::Outcome, _)) => Ok(Captured {
            cell,
            pairs,
            cell_raw,
            pairs_raw,
        }),
        other => Err(format!("no outcome: {other:?}")),
    }
}

/// A connected TCP socket: (the client's end, the end a relay serves).
pub fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let client = TcpStream::connect(listener.local_addr().unwrap()).expect("connect");
    let (served, _) = listener.accept().expect("accept");
    (client, served)
}

/// A running process that wrote the kept documents: the descriptors it will send and the
/// clients' ends of the carried connections, by the document's descriptor index.
pub struct Giver {
    pub listener: wire::Listener,
    pub ws: TcpListener,
    pub http: TcpListener,
    /// The carried connections: descriptor index → the client's end.
    pub clients: HashMap<usize, TcpStream>,
    served: HashMap<usize, OwnedFd>,
    stderr: OwnedFd,
}

impl Giver {
    /// Listens on `socket` (where the next process is told to look); `stderr` is where the
    /// next process will log (the document's standard error).
    pub fn listen(socket: &Path, stderr: OwnedFd) -> Giver {
        Giver {
            listener: wire::Listener::bind(socket).expect("bind the handover socket"),
            ws: TcpListener::bind("127.0.0.1:0").expect("bind ws"),
            http: TcpListener::bind("127.0.0.1:0").expect("bind http"),
            clients: HashMap::new(),
            served: HashMap::new(),
            stderr,
        }
    }

    /// A fresh connection for the carried one at descriptor `index`.
    fn connection(&mut self, index: usize) {
        let (client, served) = tcp_pair();
        self.clients.insert(index, client);
        self.served.insert(index, OwnedFd::from(served));
    }

    /// The descriptors of the cell document, in its order.
    fn cell_fds(&mut self, document: &Value) -> Vec<RawFd> {
        let listeners = &document["listeners"];
        let mut fds: HashMap<usize, RawFd> = HashMap::new();
        fds.insert(
            listeners["ws"].as_u64().unwrap() as usize,
            self.ws.as_raw_fd(),
        );
        fds.insert(
            listeners["http"].as_u64().unwrap() as usize,
            self.http.as_raw_fd(),
        );
        if let Some(stderr) = listeners["stderr"].as_u64() {
            fds.insert(stderr as usize, self.stderr.as_raw_fd());
        }
        for record in document["connections"].as_array().unwrap() {
            let index = record["fd"].as_u64().unwrap() as usize;
            self.connection(index);
            fds.insert(index, self.served[&index].as_raw_fd());
        }
        in_order(fds)
    }

    /// The descriptors of the pairs document, in its order (indices of their own: the pairs'
    /// connections are told apart from the cell's by the caller, which takes them after).
    fn pair_fds(&mut self, document: &Value, offset: usize) -> Vec<RawFd> {
        let mut fds: HashMap<usize, RawFd> = HashMap::new();
        for entry in document["pairs"].as_array().unwrap() {
            for leg in ["phoneFd", "hostFd"] {
                if let Some(index) = entry[leg].as_u64() {
                    let index = index as usize;
                    self.connection(offset + index);
                    fds.insert(index, self.served[&(offset + index)].as_raw_fd());
                }
            }
        }
        in_order(fds)
    }

    /// Hands the kept documents to the next process that says `ready` with `token`, and
    /// commits. `from_version` is the giving build's version. Err: what went wrong, or the
    /// next process's own cause.
    pub fn hand_over(
        &mut self,
        token: &str,
        captured: &Captured,
        from_version: &str,
        pairs_offset: usize,
    ) -> Result<(), String> {
        let (_keep, never) = wire::pair().expect("a channel that never speaks");
        // A next process of this build first asks who serves (a connection that says nothing
        // and closes), as a running process sees it: skipped.
        let (next, ready) = loop {
            let next = match self.listener.accept(never.as_raw_fd(), deadline()) {
                Ok(Some(channel)) => channel,
                other => return Err(format!("no next process: {other:?}")),
            };
            match receive(&next, deadline()) {
                Ok((Kind::Ready, message)) => {
                    let ready: Ready = body(&message).map_err(|e| e.to_string())?;
                    break (next, ready);
                }
                Ok((Kind::Failed, message)) => {
                    let cause: Cause = body(&message).map_err(|e| e.to_string())?;
                    return Err(format!("the next process failed: {}", cause.cause));
                }
                Err(wire::WireError::Closed) => continue,
                other => return Err(format!("not ready: {other:?}")),
            }
        };
        if ready.token != token {
            return Err("another token".into());
        }
        let cell: Value = serde_json::from_slice(&captured.cell).unwrap();
        let version = cell["v"].as_u64().unwrap() as u32;
        if !ready.reads.contains(&version) {
            return Err(format!(
                "the next process does not read version {version}: {:?}",
                ready.reads
            ));
        }
        let header = |document: &[u8], fds: usize| Transfer {
            version,
            document_bytes: document.len(),
            fds,
            notify_socket: None,
            watchdog_usec: None,
            from_pid: std::process::id(),
            from_version: from_version.to_string(),
            raw: Vec::new(),
            // As a build before memfd transfers: the bytes in chunks.
            memfd_raw: None,
        };
        let limits = (Duration::from_secs(5), deadline());
        let fds = self.cell_fds(&cell);
        let mut cell_header = header(&captured.cell, fds.len());
        cell_header.raw = captured.cell_raw.iter().map(Vec::len).collect();
        protocol::send_transfer(
            &next,
            &cell_header,
            &captured.cell,
            &fds,
            &captured.cell_raw,
            limits,
        )
        .map_err(|e| e.to_string())?;
        self.expect(&next, Kind::Built)?;
        let pairs: Value = serde_json::from_slice(&captured.pairs).unwrap();
        let fds = self.pair_fds(&pairs, pairs_offset);
        let mut pairs_header = header(&captured.pairs, fds.len());
        pairs_header.raw = captured.pairs_raw.iter().map(Vec::len).collect();
        protocol::send_transfer(
            &next,
            &pairs_header,
            &captured.pairs,
            &fds,
            &captured.pairs_raw,
            limits,
        )
        .map_err(|e| e.to_string())?;
        self.expect(&next, Kind::Confirm)?;
        send(&next, Kind::Committed, &serde_json::json!({}), deadline())
            .map_err(|e| e.to_string())?;
        // Committed: as a running process that exits, this one keeps no copy of anything.
        self.served.clear();
        Ok(())
    }

    fn expect(&self, next: &Channel, wanted: Kind) -> Result<(), String> {
        let mut received = receive(next, deadline());
        // A next process of this build says it is alive meanwhile.
        while matches!(received, Ok((Kind::Alive, _))) {
            received = receive(next, deadline());
        }
        match received {
            Ok((kind, _)) if kind == wanted => Ok(()),
            Ok((Kind::Failed, message)) => {
                let cause: Cause = body(&message).map_err(|e| e.to_string())?;
                Err(format!("the next process failed: {}", cause.cause))
            }
            other => Err(format!("expected {wanted:?}: {other:?}")),
        }
    }
}

fn in_order(fds: HashMap<usize, RawFd>) -> Vec<RawFd> {
    (0..fds.len())
        .map(|index| *fds.get(&index).expect("descriptor indices without a gap"))
        .collect()
}
