//! How a connection that is not admitted is answered and let go, without waiting: an upgrade
//! refused with its HTTP status, a pending leg (or one whose credential was just refused) failed
//! with a close frame, both written without blocking (a fresh socket's send buffer takes them)
//! and counted, the TCP connection dropped by the reaper: a refused upgrade a moment later
//! whatever the client does, a failed leg as soon as the client has answered the close (at the
//! latest [`CLOSE_LINGER`] later).
//! Also the pending plane's other small writes (a pong, an empty close): [`write_now`].

use std::io::{self, Write};
use std::net::TcpStream;
use std::sync::Arc;

use super::context::RelayContext;
use super::frames::{close_frame, CloseAnswer};
use super::socket::{Socket, CLOSE_LINGER};
use super::upgrade::{self, Refusal};
use crate::protocol::CloseCode;

/// Writes `bytes` without waiting; true only if all of them went out.
pub fn write_now(stream: &TcpStream, bytes: &[u8]) -> bool {
    let mut written = 0;
    while written < bytes.len() {
        match (&*stream).write(&bytes[written..]) {
            Ok(0) => return false,
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

/// A server frame (unmasked) of a control opcode: close `0x88`, pong `0x8A`; `payload` is at
/// most 125 bytes.
pub fn server_frame(first: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len().min(125);
    let mut out = Vec::with_capacity(2 + len);
    out.push(first);
    out.push(len as u8);
    out.extend_from_slice(&payload[..len]);
    out
}

/// Fails a pending leg (or one whose credential was just refused) with a close frame, written
/// without waiting, counted; the TCP connection is dropped as soon as the client has answered
/// the close (the reaper reads it for that, `answer` saying where its frames stand), and at the
/// latest [`CLOSE_LINGER`] later whatever the client does.
pub fn close_pending(
    context: &RelayContext,
    stream: TcpStream,
    answer: CloseAnswer,
    code: CloseCode,
    reason: &str,
) {
    let _ = write_now(&stream, &close_frame(Some(code.code()), reason));
    context.metrics.close(code);
    close_later(context, stream, answer);
}

/// [`close_pending`] for a leg already wrapped in its [`Socket`] (still non-blocking, written
/// by nobody else yet, read by nobody else any more).
pub fn close_pending_socket(
    context: &RelayContext,
    socket: Arc<Socket>,
    answer: CloseAnswer,
    code: CloseCode,
    reason: &str,
) {
    let _ = write_now(socket.stream(), &close_frame(Some(code.code()), reason));
    context.metrics.close(code);
    context.reaper.watch(socket, answer, CLOSE_LINGER);
}

/// Hands a closed pending connection to the reaper, which drops it once the client's answer
/// has arrived (`answer`), at the latest [`CLOSE_LINGER`] from now.
pub fn close_later(context: &RelayContext, stream: TcpStream, answer: CloseAnswer) {
    context
        .reaper
        .watch_stream(Arc::new(stream), answer, CLOSE_LINGER);
}

/// Refuses an upgrade: counted, answered (without waiting), our side closed, and the socket
/// dropped [`upgrade::REFUSAL_LINGER`] later whatever the client sends. Every refusal of the
/// WebSocket port goes through here.
pub fn refuse(context: &RelayContext, stream: TcpStream, refusal: &Refusal) {
    context
        .metrics
        .upgrade_refused(refusal.status, refusal.reason);
    let _ = write_now(&stream, upgrade::refusal(refusal).as_bytes());
    let _ = stream.shutdown(std::net::Shutdown::Write);
    context
        .reaper
        .schedule_stream(Arc::new(stream), upgrade::REFUSAL_LINGER);
}

/// Refuses a connection at accept, before any head is read (a descriptor could not be had).
pub fn refuse_at_accept(context: &RelayContext, stream: TcpStream, reason: &'static str) {
    let _ = stream.set_nonblocking(true);
    refuse(context, stream, &Refusal::unavailable(reason));
}
