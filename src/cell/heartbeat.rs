//! The `heartbeat` thread (SPEC §5.6): every `HEARTBEAT_MS`, the cell tells each director it is
//! alive, ready or not, and how many connections it holds. One request in flight at a time
//! (the thread posts to each director in turn, each with a 10 s timeout). In the combined role
//! the heartbeat goes straight into the store instead, since the director is in-process.
//!
//! Each beat carries the cell's `status` report (`cell::status_report`), an additive field.
//!
//! A change of the `ready` flag is sent at once (noticed within [`READY_WATCH`]) rather than at
//! the next period: a cell that has just started serving is placeable within a fraction of a
//! second instead of one `HEARTBEAT_MS` later, and one that stops being ready stops getting
//! desktops as soon as the director hears it. The flag moves only with readiness probes and
//! phase changes, so this adds at most one beat per probe period.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use serde::Serialize;

use crate::clock::{Clock, SharedClock};
use crate::logging::KeyedThrottle;
use crate::service_token::ServiceTokens;
use crate::store::{HeartbeatOutcome, Store};

/// Per-request timeout of a heartbeat POST.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the thread samples the cell between beats to notice a change of `ready`.
pub const READY_WATCH: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Heartbeat {
    pub v: u32,
    pub cell_id: String,
    pub cell_url: String,
    pub region: String,
    pub incarnation: i64,
    pub started_at: i64,
    pub ready: bool,
    pub connections: i64,
    /// Where directors reach this cell's `/internal/*`: a director that does not know the cell
    /// (it forgot it, or its database was rebuilt) registers it from the heartbeat, URL
    /// included, so the cell is booked and polled again without a restart.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub internal_url: Option<String>,
    /// The same `status` object as the seat feed's (`cell::status_report`). A heartbeat is not
    /// dead-man contact, so a director that cannot poll this cell still sees it held or tripped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<crate::cell::status_report::StatusReport>,
}

/// Where heartbeats go (and, on a clean exit, the deregistration).
#[derive(Clone)]
pub enum Sink {
    Directors {
        urls: Vec<String>,
        service_token: ServiceTokens,
    },
    /// The combined role: the director is in-process, the beat goes into the store (stamped
    /// with the database's clock); a cell the store does not know is registered first.
    Store { store: Store },
}

/// The thread body: `sample` builds the current heartbeat; returns when `stop` fires. A beat
/// goes out every `period`, and at once when `ready` differs from the last beat sent. A
/// director that keeps failing is logged on its first failure, then at most once a minute with
/// a count, and once when it answers again (`logging::KeyedThrottle`, driven by `clock`).
pub fn run(
    sink: Sink,
    period: Duration,
    sample: impl Fn() -> Heartbeat,
    clock: SharedClock,
    stop: Receiver<()>,
    last_beat: LastBeat,
    progress: &crate::liveness::Beat,
) {
    let agent = ureq::AgentBuilder::new().timeout(HEARTBEAT_TIMEOUT).build();
    let failures = KeyedThrottle::new();
    loop {
        // A critical thread: it shows progress every turn (at most READY_WATCH apart), and is
        // not judged while a delivery waits on a director or the store.
        progress.beat();
        let beat = sample();
        let due = match last_beat.get() {
            None => true,
            Some((sent_at, ready)) => {
                ready != beat.ready || crate::clock::instant() >= sent_at + period
            }
        };
        if due {
            last_beat.set(crate::clock::instant(), beat.ready);
            progress.waiting(|| deliver(&sink, &agent, &beat, &failures, clock.as_ref()));
        }
        match stop.recv_timeout(READY_WATCH.min(period)) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}

/// When the last beat was sent and the `ready` it carried: shared with the cell, so a live
/// handover carries the heartbeat's timer (the next process beats when this one would have).
#[derive(Debug, Clone, Default)]
pub struct LastBeat(std::sync::Arc<std::sync::Mutex<Option<(std::time::Instant, bool)>>>);

impl LastBeat {
    pub fn starting_at(last: Option<(std::time::Instant, bool)>) -> LastBeat {
        LastBeat(std::sync::Arc::new(std::sync::Mutex::new(last)))
    }

    pub fn get(&self) -> Option<(std::time::Instant, bool)> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, at: std::time::Instant, ready: bool) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((at, ready));
    }
}

/// Sends one beat to every sink, logging failures and recoveries through `failures`.
fn deliver(
    sink: &Sink,
    agent: &ureq::Agent,
    beat: &Heartbeat,
    failures: &KeyedThrottle,
    clock: &dyn Clock,
) {
    let outcome = |target: &str, result: Result<(), String>| match result {
        Ok(()) => {
            if let Some(note) = failures.success(target) {
                log::info!(
                    "orca_relay_heartbeat_recovered cell_id={} director={target}{note}",
                    beat.cell_id
                );
            }
        }
        Err(line) => {
            if let Some(note) = failures.failure(target, clock.now_ms()) {
                log::warn!("{line}{note}");
            }
        }
    };
    match sink {
        Sink::Directors {
            urls,
            service_token,
        } => {
            // Every director hears the beat, even after one failed.
            for url in urls {
                outcome(url, send(agent, url, service_token, beat));
            }
        }
        Sink::Store { store } => outcome("in-process", record_in_store(store, beat)),
    }
}

/// The combined role's beat: recorded in the store; a cell the store no longer knows (it was
/// forgotten) is registered again from the beat and recorded.
fn record_in_store(store: &Store, beat: &Heartbeat) -> Result<(), String> {
    let record = || {
        let advertised = crate::store::Advertised {
            cell_url: &beat.cell_url,
            region: &beat.region,
            internal_url: beat.internal_url.as_deref(),
        };
        store
            .heartbeat_advertised(
                &beat.cell_id,
                beat.incarnation,
                beat.started_at,
                beat.ready,
                beat.connections,
                advertised,
            )
            .map(|(outcome, _)| outcome)
    };
    let outcome = record().and_then(|outcome| match outcome {
        HeartbeatOutcome::Unregistered => {
            store.register_cell(
                &beat.cell_id,
                &beat.cell_url,
                beat.internal_url.as_deref().unwrap_or(""),
                &beat.region,
                beat.incarnation,
            )?;
            record()
        }
        other => Ok(other),
    });
    match outcome {
        Ok(HeartbeatOutcome::Accepted) => Ok(()),
        Ok(HeartbeatOutcome::StaleIncarnation | HeartbeatOutcome::Unregistered) => Err(format!(
            "orca_relay_heartbeat_stale cell_id={} director=in-process",
            beat.cell_id
        )),
        Err(e) => Err(format!(
            "orca_relay_heartbeat_failed cell_id={} director=in-process {}",
            beat.cell_id,
            e.log_fields()
        )),
    }
}

/// Timeout of one deregistration call.
pub const DEREGISTER_TIMEOUT: Duration = Duration::from_secs(2);

/// A draining cell's last word to its directors (SPEC §11 "Fleet membership"): its registration
/// goes at once, so no director polls it or places a desktop on it until it registers again.
/// Called after the heartbeat thread has stopped (a later heartbeat would register it again).
/// Best effort, one bounded call per director: a director that misses it retires the cell once
/// it has been silent for `ORCA_RELAY_CELL_RETIRE_MS`.
pub fn deregister(sink: &Sink, cell_id: &str, incarnation: i64) {
    match sink {
        Sink::Directors {
            urls,
            service_token,
        } => {
            let agent = ureq::AgentBuilder::new()
                .timeout(DEREGISTER_TIMEOUT)
                .build();
            let body = serde_json::json!({"v": 1, "cellId": cell_id, "incarnation": incarnation});
            for director in urls {
                let url = format!("{director}/v1/admin/cells/deregister");
                match service_token.call_http(
                    director,
                    DEREGISTER_TIMEOUT,
                    |token, left| {
                        agent
                            .post(&url)
                            .timeout(left)
                            .set("Authorization", &format!("Bearer {token}"))
                            .send_json(&body).map_err(Box::new)
                    },
                                    ).map_err(|error| *error) {
                    Ok(_) => log::info!(
                        "orca_relay_cell_deregistered cell_id={cell_id} incarnation={incarnation} director={director}"
                    ),
                    Err(e) => log::warn!(
                        "orca_relay_cell_deregister_failed cell_id={cell_id} director={director} error={e}"
                    ),
                }
            }
        }
        Sink::Store { store } => match store.deregister_cell(cell_id, incarnation) {
            Ok(_) => log::info!(
                "orca_relay_cell_deregistered cell_id={cell_id} incarnation={incarnation} director=in-process"
            ),
            Err(e) => log::warn!(
                "orca_relay_cell_deregister_failed cell_id={cell_id} director=in-process {}",
                e.log_fields()
            ),
        },
    }
}

/// One POST; `Err` is the failure's log line (without the throttle's note).
fn send(
    agent: &ureq::Agent,
    director: &str,
    tokens: &ServiceTokens,
    beat: &Heartbeat,
) -> Result<(), String> {
    let url = format!("{director}/v1/admin/cell-heartbeat");
    match tokens
        .call_http(director, HEARTBEAT_TIMEOUT, |token, left| {
            agent
                .post(&url)
                .timeout(left)
                .set("Authorization", &format!("Bearer {token}"))
                .send_json(beat)
                .map_err(Box::new)
        })
        .map_err(|error| *error)
    {
        Ok(_) => Ok(()),
        Err(ureq::Error::Status(409, _)) => Err(format!(
            "orca_relay_heartbeat_stale cell_id={} director={director}",
            beat.cell_id
        )),
        Err(ureq::Error::Status(code, _)) => Err(format!(
            "orca_relay_heartbeat_failed cell_id={} director={director} status={code}",
            beat.cell_id
        )),
        Err(e) => Err(format!(
            "orca_relay_heartbeat_failed cell_id={} director={director} error={}",
            beat.cell_id,
            one_token(&e.to_string())
        )),
    }
}

/// An error text as one `key=value` token: whitespace becomes `_`.
fn one_token(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join("_")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc, Mutex};

    /// A local director that records the `ready` of every beat it receives.
    fn director() -> (String, Arc<Mutex<Vec<bool>>>, Arc<tiny_http::Server>) {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let url = format!("http://{}", server.server_addr().to_ip().unwrap());
        let beats: Arc<Mutex<Vec<bool>>> = Arc::default();
        let (serving, seen) = (server.clone(), beats.clone());
        crate::threads::spawn("test-director", move || {
            while let Ok(mut request) = serving.recv() {
                use std::io::Read;
                let mut body = String::new();
                let _ = request
                    .as_reader()
                    .take(64 * 1024)
                    .read_to_string(&mut body);
                let value: serde_json::Value = serde_json::from_str(&body).unwrap();
                seen.lock().unwrap().push(value["ready"].as_bool().unwrap());
                let _ = request.respond(tiny_http::Response::from_string("{}"));
            }
        })
        .unwrap();
        (url, beats, server)
    }

    fn wait_for(what: &str, condition: impl Fn() -> bool) {
        let deadline = crate::clock::instant() + Duration::from_secs(10);
        while !condition() {
            assert!(crate::clock::instant() < deadline, "timed out: {what}");
            crate::clock::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_change_of_ready_is_sent_at_once_not_a_period_later() {
        let (url, beats, server) = director();
        let ready = Arc::new(AtomicBool::new(false));
        let sample = {
            let ready = ready.clone();
            move || Heartbeat {
                v: 1,
                cell_id: "c7".into(),
                cell_url: "ws://c7".into(),
                region: "r".into(),
                incarnation: 1,
                started_at: 1,
                ready: ready.load(Ordering::SeqCst),
                connections: 0,
                internal_url: None,
                status: None,
            }
        };
        let (stop, stop_rx) = mpsc::channel();
        let sink = Sink::Directors {
            urls: vec![url],
            service_token: ServiceTokens::single("t"),
        };
        // A period far longer than the test: only the flip can cause the second beat.
        let liveness = crate::liveness::Liveness::detached(crate::clock::system());
        let thread = crate::threads::spawn("test-heartbeat", move || {
            let progress = liveness.register("heartbeat", crate::liveness::BEAT_PERIOD);
            run(
                sink,
                Duration::from_secs(3600),
                sample,
                crate::clock::system(),
                stop_rx,
                LastBeat::default(),
                &progress,
            )
        })
        .unwrap();
        wait_for("the first beat", || beats.lock().unwrap().len() == 1);
        assert_eq!(*beats.lock().unwrap(), vec![false]);
        ready.store(true, Ordering::SeqCst);
        wait_for("the ready beat", || beats.lock().unwrap().len() == 2);
        assert_eq!(*beats.lock().unwrap(), vec![false, true]);
        drop(stop);
        thread.join().unwrap();
        server.unblock();
        assert_eq!(beats.lock().unwrap().len(), 2, "no beat without a change");
    }
}
