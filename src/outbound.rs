//! What a failed outbound HTTP call (ureq) was: the one place that tells a timeout we set from
//! any other transport failure, for every caller (handshake, heartbeats, feed polls, JWKS
//! fetches, `fleet status`).
//!
//! ureq 2 reports its deadline as an `io::Error` of kind `TimedOut` somewhere in the transport
//! error's source chain (it normalises the `WouldBlock` a socket read timeout gives on Unix; we
//! accept both). Floor 1: no imports from the crate.

use std::error::Error as StdError;
use std::io;

/// An I/O error that is a timeout (ours), not the peer failing.
pub fn is_timeout_io(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    )
}

/// A transport failure caused by the timeout we set, found anywhere in its source chain.
pub fn is_timeout(transport: &ureq::Transport) -> bool {
    let mut source: Option<&(dyn StdError + 'static)> = transport.source();
    while let Some(error) = source {
        if error.downcast_ref::<io::Error>().is_some_and(is_timeout_io) {
            return true;
        }
        source = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_a_timeout_and_a_refusal_is_not() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/", silent.local_addr().unwrap());
        let agent = ureq::AgentBuilder::new()
            .timeout(std::time::Duration::from_millis(100))
            .build();
        match agent.get(&url).call() {
            Err(ureq::Error::Transport(transport)) => assert!(is_timeout(&transport)),
            other => panic!("a silent server: {other:?}"),
        }
        drop(silent);
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/", closed.local_addr().unwrap());
        drop(closed);
        match agent.get(&url).call() {
            Err(ureq::Error::Transport(transport)) => assert!(!is_timeout(&transport)),
            other => panic!("a closed port: {other:?}"),
        }
        assert!(is_timeout_io(&io::Error::from(io::ErrorKind::WouldBlock)));
        assert!(!is_timeout_io(&io::Error::from(
            io::ErrorKind::ConnectionReset
        )));
    }
}
