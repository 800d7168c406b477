//! The `heartbeat` thread (SPEC §5.6): every `HEARTBEAT_MS`, the cell tells each director it is
//! alive, ready or not, and how many connections it holds. One request in flight at a time
//! (the thread posts to each director in turn, each with a 10 s timeout). In the combined role
//! the heartbeat goes straight into the store instead, since the director is in-process.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use serde::Serialize;

use crate::store::{HeartbeatOutcome, Store};

/// Per-request timeout of a heartbeat POST.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

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
}

/// Where heartbeats go.
pub enum Sink {
    Directors {
        urls: Vec<String>,
        service_token: String,
    },
    Store(Store),
}

/// The thread body: `sample` builds the current heartbeat; returns when `stop` fires.
pub fn run(sink: Sink, period: Duration, sample: impl Fn() -> Heartbeat, stop: Receiver<()>) {
    let agent = ureq::AgentBuilder::new().timeout(HEARTBEAT_TIMEOUT).build();
    let mut failing = false;
    loop {
        let beat = sample();
        let ok = match &sink {
            Sink::Directors {
                urls,
                service_token,
            } => {
                // Every director hears the beat, even after one failed.
                let failures = urls
                    .iter()
                    .filter(|url| !send(&agent, url, service_token, &beat))
                    .count();
                failures == 0
            }
            Sink::Store(store) => match store.heartbeat(
                &beat.cell_id,
                beat.incarnation,
                beat.started_at,
                beat.ready,
                beat.connections,
                crate::clock::system().now_ms() as i64,
            ) {
                Ok(HeartbeatOutcome::Accepted) => true,
                Ok(HeartbeatOutcome::StaleIncarnation) => {
                    log::warn!("orca_relay_heartbeat_stale cell_id={}", beat.cell_id);
                    false
                }
                Err(e) => {
                    log::debug!("orca_relay_heartbeat_failed reason={}", e.reason_code());
                    false
                }
            },
        };
        if ok && failing {
            log::info!("orca_relay_heartbeat_recovered cell_id={}", beat.cell_id);
        }
        failing = !ok;
        match stop.recv_timeout(period) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}

fn send(agent: &ureq::Agent, director: &str, token: &str, beat: &Heartbeat) -> bool {
    let url = format!("{director}/v1/admin/cell-heartbeat");
    match agent
        .post(&url)
        .set("Authorization", &format!("Bearer {token}"))
        .send_json(beat)
    {
        Ok(_) => true,
        Err(ureq::Error::Status(409, _)) => {
            log::warn!(
                "orca_relay_heartbeat_stale cell_id={} director={director}",
                beat.cell_id
            );
            false
        }
        Err(ureq::Error::Status(code, _)) => {
            log::warn!("orca_relay_heartbeat_failed director={director} status={code}");
            false
        }
        Err(e) => {
            log::warn!("orca_relay_heartbeat_failed director={director} error={e}");
            false
        }
    }
}
