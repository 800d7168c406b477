//! A TCP proxy that can stop forwarding: a network partition between two processes on one
//! machine. While it is *cut*, bytes that arrive (in either direction) are held, not dropped,
//! and connections are accepted but not passed on; on *heal* everything held flows, as it would
//! after a real partition once TCP retransmits. It records when bytes went from the client
//! side to the target, so a test can tell when the first request reached the target after the
//! heal.
//!
//! The target may be set after the proxy starts (a process whose port is not known yet, which
//! must nevertheless register the proxy's address): until then connections wait, as when cut.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    target: Option<SocketAddr>,
    cut: bool,
    /// When bytes were written to the target (client → target), in order.
    forwarded: Vec<Instant>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the proxy forwards (a target, not cut); returns the target, or `None` once
    /// stopped.
    fn wait_open(&self) -> Option<SocketAddr> {
        let mut state = self.lock();
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            if let (Some(target), false) = (state.target, state.cut) {
                return Some(target);
            }
            state = self
                .changed
                .wait_timeout(state, Duration::from_millis(200))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

pub struct Proxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Proxy {
    /// A proxy to `target` (or to a target set later), forwarding.
    pub fn start(target: Option<SocketAddr>) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        shared.lock().target = target;
        let accepting = shared.clone();
        std::thread::Builder::new()
            .name("test-proxy".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if accepting.stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let shared = accepting.clone();
                    std::thread::Builder::new()
                        .name("test-proxy-conn".into())
                        .spawn(move || connect_and_pump(client, shared))
                        .expect("spawn a proxy connection");
                }
            })
            .expect("spawn the proxy");
        Proxy { addr, shared }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_target(&self, target: SocketAddr) {
        self.shared.lock().target = Some(target);
        self.shared.changed.notify_all();
    }

    /// Stops forwarding: whatever arrives is held.
    pub fn cut(&self) {
        self.shared.lock().cut = true;
        self.shared.changed.notify_all();
    }

    /// Forwards again, what was held first; returns the moment of the heal.
    pub fn heal(&self) -> Instant {
        let mut state = self.shared.lock();
        state.cut = false;
        let healed = orca_relay::clock::instant();
        drop(state);
        self.shared.changed.notify_all();
        healed
    }

    /// The first moment bytes went to the target at or after `since`.
    pub fn first_forward_since(&self, since: Instant) -> Option<Instant> {
        self.shared
            .lock()
            .forwarded
            .iter()
            .copied()
            .find(|at| *at >= since)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        let _ = TcpStream::connect(self.addr);
    }
}

fn connect_and_pump(client: TcpStream, shared: Arc<Shared>) {
    let Some(target) = shared.wait_open() else {
        return;
    };
    let Ok(upstream) = TcpStream::connect(target) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let (Ok(client_reader), Ok(upstream_reader)) = (client.try_clone(), upstream.try_clone())
    else {
        return;
    };
    let back = shared.clone();
    let reverse = std::thread::Builder::new()
        .name("test-proxy-back".into())
        .spawn(move || pump(upstream_reader, client, &back, false))
        .expect("spawn a proxy pump");
    pump(client_reader, upstream, &shared, true);
    let _ = reverse.join();
}

/// Copies `from` to `to`, holding each chunk while the proxy is cut.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared, to_target: bool) {
    let mut buffer = [0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if shared.wait_open().is_none() {
            break;
        }
        if to.write_all(&buffer[..read]).is_err() {
            break;
        }
        if to_target {
            shared.lock().forwarded.push(orca_relay::clock::instant());
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
