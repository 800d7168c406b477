//! docs/PROTOCOL.md is enough to build a client: an independent WebSocket implementation
//! (Python's `websockets`, Debian's python3-websockets, which `scripts/test` installs) drives
//! the whole protocol against the real binary, written from the document alone
//! (tests/independent_client/client.py reads nothing of `src/`). Placement, the control and
//! its hello, invites, phones and data legs, text, binary and fragmented messages byte for
//! byte, pings, every documented close code and HTTP refusal with its exact code, status, reason
//! and limit, keepalive, the connection cap and a drain. A changed code, status or limit fails
//! it, and so does a document whose tables no longer say what the client pins.
//!
//! The module missing is a failure, never a skip. `ORCA_RELAY_TEST_PYTHON` names another
//! interpreter than `/usr/bin/python3` (Debian's, for which the package installs).

mod harness;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use harness::*;

/// The whole run takes about 35 s (its longest scenario waits for two of the relay's 15 s
/// pings); this is the most it may take before it is killed.
const RUN_LIMIT: Duration = Duration::from_secs(240);

fn python() -> String {
    std::env::var("ORCA_RELAY_TEST_PYTHON").unwrap_or_else(|_| "/usr/bin/python3".to_string())
}

/// What the client is told of one relay: its addresses, pid and timing knobs.
fn describe(relay: &Relay) -> serde_json::Value {
    let env: serde_json::Map<String, serde_json::Value> = relay
        .env
        .iter()
        .filter(|(name, _)| name.starts_with("ORCA_RELAY_") && name.ends_with("_MS"))
        .map(|(name, value)| (name.clone(), serde_json::Value::from(value.clone())))
        .collect();
    serde_json::json!({"ws": relay.ws, "http": relay.http, "pid": relay.pid(), "env": env})
}

#[test]
fn an_independent_client_drives_the_whole_protocol_from_the_document() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The documented timings, except where a scenario needs a shorter one (the document: an
    // operator may shrink them); a cap of two connections; a drain with a short grace (and a
    // first-frame deadline past it, so a pending phone meets the drain, not its deadline).
    let defaults = Relay::combined(&[]);
    let short = Relay::combined(&[
        ("ORCA_RELAY_PING_MS", "500"),
        ("ORCA_RELAY_SILENCE_MS", "2500"),
        ("ORCA_RELAY_SPLICE_IDLE_MS", "2000"),
    ]);
    let cap = Relay::combined(&[("ORCA_RELAY_CONNECTION_CAP", "2")]);
    let mut drain = Relay::combined(&[
        ("ORCA_RELAY_DRAIN_GRACE_MS", "1500"),
        ("ORCA_RELAY_FIRST_FRAME_MS", "10000"),
    ]);
    let context = serde_json::json!({
        "doc": root.join("docs/PROTOCOL.md"),
        "key": TEST_KEY,
        "relays": {
            "defaults": describe(&defaults),
            "short": describe(&short),
            "cap": describe(&cap),
            "drain": describe(&drain),
        },
    });
    let python = python();
    let mut child = Command::new(&python)
        .arg(root.join("tests/independent_client/client.py"))
        .arg(context.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {python} (set ORCA_RELAY_TEST_PYTHON): {e}"));
    let readers: Vec<_> = [
        Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ]
    .into_iter()
    .map(|mut pipe| {
        orca_relay::threads::spawn("test-client-output", move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
        .expect("a thread to read the client's output")
    })
    .collect();
    let started = now_instant();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        orca_relay::clock::sleep(Duration::from_millis(100));
    };
    // The process has ended: its output is read to the end before it is judged.
    let output: Vec<String> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    let report = format!(
        "{python} tests/independent_client/client.py\n--- stdout\n{}\n--- stderr\n{}",
        output[0], output[1]
    );
    println!("{report}");
    match status {
        Some(status) => assert!(
            status.success(),
            "the independent client failed ({status}):\n{report}"
        ),
        None => panic!("the independent client took over {RUN_LIMIT:?}:\n{report}"),
    }
    // The drained relay exits 0 once its grace is over.
    assert_eq!(
        drain.wait_exit(Duration::from_secs(30)),
        Some(0),
        "the drained relay's exit; log:\n{}",
        drain.log_text()
    );
}
