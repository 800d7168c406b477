//! The director's admin API (SPEC §6.2), behind `Authorization: Bearer $SERVICE_TOKEN`:
//! - `POST /v1/admin/cells/register`: a cell's startup registration (SPEC §8);
//! - `POST /v1/admin/cell-heartbeat`: a cell's heartbeat (SPEC §5.6), the receiving side;
//! - `PUT /v1/admin/cell-admit-mode`: the operator's record of a cell's switch;
//! - `POST /v1/admin/cells/deregister` `{"v":1,"cellId","incarnation"}`: a draining cell's
//!   clean exit (SPEC §11): its registration and runtime row go at once, so the feed poller
//!   stops polling it and placement forgets it without waiting for it to retire;
//! - `GET /v1/admin/cells`: every cell this director knows, with its membership (live,
//!   draining, retired) and what the database and the feed poller say about it
//!   ([`fleet_listing`], `{"v":1,…}`; `orca-relay fleet status` reads it).
//!
//! Runs on the HTTP workers; each request is a token check, a bounded body read and one or two
//! store calls. Must never: read a body before the token matched (constant-time compare), read
//! more than 16 KiB of one, or let an older incarnation overwrite a newer one.
//!
//! Decisions worth knowing:
//! - Registration is idempotent: the same `(cellId, incarnation)` again is the same
//!   registration. A *lower* incarnation than the stored one is 409 `stale_cell_incarnation`.
//! - A heartbeat from a cell this database does not know (a director whose database was
//!   rebuilt, a registration that went to another director only) **registers the cell** from
//!   the heartbeat's own fields and is then recorded, rather than answering 404: cells do not
//!   re-register after startup, so a 404 would keep a live cell unplaceable until it restarts.
//!   The heartbeat carries `internalUrl`, so a cell registered this way (or again, after it
//!   was forgotten) is booked and polled like any other.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{json, Value};

use super::feed_poller::{FeedBoard, FeedStatus};
use super::membership::{self, Judge};
use crate::clock::SharedClock;
use crate::config::is_id;
use crate::http::{BodyError, Reply, Request};
use crate::metrics::Registry;
use crate::service_token::ServiceTokens;
use crate::store::{CellRow, HeartbeatOutcome, Store, StoreError, MODE_DB, MODE_RESERVE};

/// Largest admin body (SPEC §5.4, the same limit as the cell's internal API).
pub const ADMIN_BODY_LIMIT: usize = 16 * 1024;
/// Longest URL or region label accepted.
const MAX_TEXT_LEN: usize = 2_048;

pub const REGISTER_PATH: &str = "/v1/admin/cells/register";
pub const HEARTBEAT_PATH: &str = "/v1/admin/cell-heartbeat";
pub const ADMIT_MODE_PATH: &str = "/v1/admin/cell-admit-mode";
pub const DEREGISTER_PATH: &str = "/v1/admin/cells/deregister";
pub const CELLS_PATH: &str = "/v1/admin/cells";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RegisterBody {
    v: u32,
    cell_id: String,
    cell_url: String,
    region: String,
    incarnation: i64,
    #[serde(default)]
    internal_url: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct HeartbeatBody {
    v: u32,
    cell_id: String,
    cell_url: String,
    region: String,
    incarnation: i64,
    started_at: i64,
    ready: bool,
    connections: i64,
    #[serde(default)]
    internal_url: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeregisterBody {
    v: u32,
    cell_id: String,
    incarnation: i64,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AdmitModeBody {
    cell_id: String,
    admit_mode: String,
}

/// Everything the admin API needs; shared by the HTTP workers.
pub struct AdminContext {
    store: Store,
    clock: SharedClock,
    /// `ORCA_RELAY_SERVICE_TOKEN`: any token of the list is accepted.
    service_tokens: ServiceTokens,
    registry: Registry,
    /// What the feed poller last saw of each cell (for `GET /v1/admin/cells`).
    board: FeedBoard,
    membership: Judge,
}

fn bad_request(reason: impl Into<String>) -> Reply {
    Reply::json(
        400,
        json!({"error": "bad_request", "reason": reason.into()}).to_string(),
    )
}

fn ok() -> Reply {
    Reply::json(200, r#"{"v":1,"ok":true}"#)
}

fn stale() -> Reply {
    Reply::error(409, "stale_cell_incarnation")
}

fn is_url(value: &str, schemes: &[&str]) -> bool {
    value.len() <= MAX_TEXT_LEN
        && schemes.iter().any(|scheme| {
            value
                .strip_prefix(scheme)
                .and_then(|rest| rest.strip_prefix("://"))
                .is_some_and(|rest| !rest.is_empty() && !rest.contains(char::is_whitespace))
        })
}

/// The fields every cell body shares, checked in one place.
fn check_cell_fields(
    v: u32,
    cell_id: &str,
    cell_url: &str,
    region: &str,
    incarnation: i64,
    internal_url: Option<&str>,
) -> Result<(), Reply> {
    if v != 1 {
        return Err(bad_request("v must be 1"));
    }
    if !is_id(cell_id, 128) {
        return Err(bad_request("cellId must be 1-128 characters [A-Za-z0-9_-]"));
    }
    if !is_url(cell_url, &["ws", "wss"]) {
        return Err(bad_request("cellUrl must be a ws:// or wss:// URL"));
    }
    if let Some(url) = internal_url {
        if !is_url(url, &["http", "https"]) {
            return Err(bad_request(
                "internalUrl must be an http:// or https:// URL",
            ));
        }
    }
    if region.is_empty() || region.len() > 128 {
        return Err(bad_request("region must be 1-128 characters"));
    }
    if incarnation < 0 {
        return Err(bad_request("incarnation must not be negative"));
    }
    Ok(())
}

impl AdminContext {
    pub fn new(
        store: Store,
        clock: SharedClock,
        service_tokens: ServiceTokens,
        registry: &Registry,
        board: FeedBoard,
        membership: Judge,
    ) -> AdminContext {
        AdminContext {
            store,
            clock,
            service_tokens,
            registry: registry.clone(),
            board,
            membership,
        }
    }

    fn count(&self, route: &str, status: u16) {
        self.registry
            .counter(
                "orca_relay_director_admin_requests_total",
                "Admin API requests, by route and status.",
                &[("route", route), ("status", &status.to_string())],
            )
            .inc();
    }

    /// Answers `/v1/admin/*`; `None` for any other path (the caller routes on).
    pub fn handle(&self, request: &mut Request<'_>) -> Option<Reply> {
        let path = request.path;
        if !path.starts_with("/v1/admin/") {
            return None;
        }
        let route = match path {
            REGISTER_PATH => "register",
            HEARTBEAT_PATH => "heartbeat",
            ADMIT_MODE_PATH => "admit_mode",
            DEREGISTER_PATH => "deregister",
            CELLS_PATH => "cells",
            _ => "other",
        };
        let reply = self.route(request);
        self.count(route, reply.status);
        Some(reply)
    }

    fn route(&self, request: &mut Request<'_>) -> Reply {
        if !self.service_tokens.accepts(request.authorization) {
            log::warn!(
                "orca_relay_director_admin_unauthorized path={} token={}",
                request.path,
                if request.authorization.is_some() {
                    "wrong"
                } else {
                    "missing"
                }
            );
            return Reply::error(401, "unauthorized");
        }
        match (request.path, request.method) {
            (REGISTER_PATH, "POST") => self.register(request),
            (HEARTBEAT_PATH, "POST") => self.heartbeat(request),
            (ADMIT_MODE_PATH, "PUT") => self.admit_mode(request),
            (DEREGISTER_PATH, "POST") => self.deregister(request),
            (CELLS_PATH, "GET") => self.cells(),
            (REGISTER_PATH | HEARTBEAT_PATH | DEREGISTER_PATH, _) => {
                Reply::error(405, "method_not_allowed").with_header("Allow", "POST")
            }
            (CELLS_PATH, _) => Reply::error(405, "method_not_allowed").with_header("Allow", "GET"),
            (ADMIT_MODE_PATH, _) => {
                Reply::error(405, "method_not_allowed").with_header("Allow", "PUT")
            }
            _ => Reply::error(404, "not_found"),
        }
    }

    fn read<T: serde::de::DeserializeOwned>(request: &mut Request<'_>) -> Result<T, Reply> {
        let body = request.body(ADMIN_BODY_LIMIT).map_err(|e| match e {
            BodyError::TooLarge => Reply::error(413, "body_too_large"),
            BodyError::Unreadable => bad_request("the body could not be read"),
        })?;
        serde_json::from_slice(&body).map_err(|e| bad_request(e.to_string()))
    }

    fn store_failed(&self, what: &str, error: &StoreError) -> Reply {
        log::warn!(
            "orca_relay_director_admin_store_failed action={what} reason={}",
            error.reason_code()
        );
        Reply::error(503, "relay_store_unavailable").with_header("Retry-After", "2")
    }

    /// The incarnation stored for `cell_id`, if the cell is registered.
    fn stored_incarnation(&self, cell_id: &str) -> Result<Option<i64>, StoreError> {
        let cells = self.store.list_cells()?;
        Ok(cells
            .into_iter()
            .find(|cell| cell.cell_id == cell_id)
            .map(|cell| cell.incarnation))
    }

    fn register(&self, request: &mut Request<'_>) -> Reply {
        let body: RegisterBody = match Self::read(request) {
            Ok(body) => body,
            Err(reply) => return reply,
        };
        if let Err(reply) = check_cell_fields(
            body.v,
            &body.cell_id,
            &body.cell_url,
            &body.region,
            body.incarnation,
            body.internal_url.as_deref(),
        ) {
            return reply;
        }
        if let Err(e) = self.store.register_cell(
            &body.cell_id,
            &body.cell_url,
            body.internal_url.as_deref().unwrap_or(""),
            &body.region,
            body.incarnation,
        ) {
            return self.store_failed("register", &e);
        }
        // The upsert never lowers an incarnation; reading it back tells a stale registration
        // (refused) from a fresh or repeated one.
        let stored = match self.stored_incarnation(&body.cell_id) {
            Ok(stored) => stored,
            Err(e) => return self.store_failed("register", &e),
        };
        match stored {
            Some(stored) if stored > body.incarnation => {
                log::warn!(
                    "orca_relay_director_cell_registration_stale cell_id={} incarnation={} stored={stored}",
                    body.cell_id,
                    body.incarnation
                );
                stale()
            }
            _ => {
                log::info!(
                    "orca_relay_director_cell_registered cell_id={} incarnation={} cell_url={} internal_url={} region={}",
                    body.cell_id,
                    body.incarnation,
                    body.cell_url,
                    body.internal_url.as_deref().unwrap_or("-"),
                    body.region
                );
                ok()
            }
        }
    }

    fn heartbeat(&self, request: &mut Request<'_>) -> Reply {
        let body: HeartbeatBody = match Self::read(request) {
            Ok(body) => body,
            Err(reply) => return reply,
        };
        if let Err(reply) = check_cell_fields(
            body.v,
            &body.cell_id,
            &body.cell_url,
            &body.region,
            body.incarnation,
            body.internal_url.as_deref(),
        ) {
            return reply;
        }
        if body.connections < 0 {
            return bad_request("connections must not be negative");
        }
        let record = || {
            self.store.heartbeat(
                &body.cell_id,
                body.incarnation,
                body.started_at,
                body.ready,
                body.connections,
            )
        };
        let outcome = record().and_then(|outcome| match outcome {
            HeartbeatOutcome::Unregistered => {
                // Not registered here (never, or forgotten): the heartbeat registers it.
                self.store.register_cell(
                    &body.cell_id,
                    &body.cell_url,
                    body.internal_url.as_deref().unwrap_or(""),
                    &body.region,
                    body.incarnation,
                )?;
                log::info!(
                    "orca_relay_director_cell_registered_by_heartbeat cell_id={} incarnation={} internal_url={}",
                    body.cell_id,
                    body.incarnation,
                    body.internal_url.as_deref().unwrap_or("-")
                );
                record()
            }
            other => Ok(other),
        });
        match outcome {
            Ok(HeartbeatOutcome::Accepted) => ok(),
            Ok(HeartbeatOutcome::StaleIncarnation | HeartbeatOutcome::Unregistered) => {
                log::warn!(
                    "orca_relay_director_heartbeat_stale cell_id={} incarnation={}",
                    body.cell_id,
                    body.incarnation
                );
                stale()
            }
            Err(e) => self.store_failed("heartbeat", &e),
        }
    }

    fn deregister(&self, request: &mut Request<'_>) -> Reply {
        let body: DeregisterBody = match Self::read(request) {
            Ok(body) => body,
            Err(reply) => return reply,
        };
        if body.v != 1 {
            return bad_request("v must be 1");
        }
        if !is_id(&body.cell_id, 128) {
            return bad_request("cellId must be 1-128 characters [A-Za-z0-9_-]");
        }
        match self.store.deregister_cell(&body.cell_id, body.incarnation) {
            Ok(removed) => {
                log::info!(
                    "orca_relay_director_cell_deregistered cell_id={} incarnation={} removed={removed}",
                    body.cell_id,
                    body.incarnation
                );
                // Idempotent: a second call, or one for an incarnation already replaced, is
                // answered the same (a newer incarnation's rows are never touched).
                Reply::json(
                    200,
                    json!({"v": 1, "ok": true, "removed": removed}).to_string(),
                )
            }
            Err(e) => self.store_failed("deregister", &e),
        }
    }

    fn cells(&self) -> Reply {
        match self.store.list_cells() {
            Ok(cells) => {
                let listing = fleet_listing(
                    &cells,
                    &self.board.status(),
                    &self.membership,
                    self.clock.monotonic_ms(),
                    self.clock.now_ms(),
                );
                Reply::json(200, listing.to_string())
            }
            Err(e) => self.store_failed("cells", &e),
        }
    }

    fn admit_mode(&self, request: &mut Request<'_>) -> Reply {
        let body: AdmitModeBody = match Self::read(request) {
            Ok(body) => body,
            Err(reply) => return reply,
        };
        if !is_id(&body.cell_id, 128) {
            return bad_request("cellId must be 1-128 characters [A-Za-z0-9_-]");
        }
        if body.admit_mode != MODE_DB && body.admit_mode != MODE_RESERVE {
            return bad_request("admitMode must be \"db\" or \"reserve\"");
        }
        match self.store.set_admit_mode(&body.cell_id, &body.admit_mode) {
            Ok(()) => {
                log::info!(
                    "orca_relay_director_admit_mode_set cell_id={} admit_mode={}",
                    body.cell_id,
                    body.admit_mode
                );
                ok()
            }
            Err(e) => self.store_failed("admit_mode", &e),
        }
    }
}

/// `GET /v1/admin/cells`, version 1: every registered cell, ordered by id. Ages are the
/// database's (`…AgeMs`), except the feed's, which is this director's own. A field this
/// director has no data for is `null`. Documented in README ("Fleet membership").
pub fn fleet_listing(
    cells: &[CellRow],
    feeds: &HashMap<String, FeedStatus>,
    judge: &Judge,
    monotonic_now_ms: u64,
    now_ms: u64,
) -> Value {
    let retire_after = judge.retire_after(monotonic_now_ms);
    let listed: Vec<Value> = cells
        .iter()
        .map(|cell| {
            let feed = feeds.get(&cell.cell_id);
            let view = feed.and_then(|feed| feed.view.as_ref());
            let draining = view
                .is_some_and(|view| view.draining && view.incarnation == cell.incarnation);
            let state = membership::membership(cell, draining, retire_after);
            json!({
                "cellId": cell.cell_id,
                "state": state.as_str(),
                "ready": cell.runtime.as_ref().map(|runtime| runtime.ready),
                "region": cell.region,
                "cellUrl": cell.cell_url,
                "internalUrl": cell.internal_url,
                "incarnation": cell.incarnation,
                "registeredAt": cell.registered_at,
                "silentMs": cell.silent_ms(),
                "heartbeat": cell.runtime.as_ref().map(|runtime| json!({
                    "incarnation": runtime.cell_incarnation,
                    "startedAt": runtime.started_at,
                    "ageMs": runtime.heartbeat_age_ms,
                    "ready": runtime.ready,
                    "connections": runtime.connections,
                })),
                "admitMode": {
                    "mode": cell.admit_mode,
                    "updatedAt": cell.admit_mode_updated_at,
                },
                "admitEffective": cell.effective.as_ref().map(|effective| json!({
                    "mode": effective.mode,
                    "incarnation": effective.cell_incarnation,
                    "ageMs": effective.age_ms,
                })),
                "feed": feed.map(|feed| json!({
                    "lane": if state == membership::Membership::Retired {
                        "none"
                    } else {
                        feed.lane.as_str()
                    },
                    "consecutiveFailures": feed.consecutive_failures,
                    "lastSuccessAgeMs": view.map(|view| now_ms.saturating_sub(view.last_success_ms)),
                    "incarnation": view.map(|view| view.incarnation),
                    "admitModeRaw": view.map(|view| view.admit_mode_raw.as_str()),
                    "admitModeEffective": view.map(|view| view.admit_mode_effective.as_str()),
                    "draining": view.map(|view| view.draining),
                    "counts": view.map(|view| json!({
                        "seated": view.seated,
                        "bookings": view.bookings,
                        "connections": view.connections,
                    })),
                })),
            })
        })
        .collect();
    json!({
        "v": 1,
        "director": {
            "uptimeMs": judge.uptime_ms(monotonic_now_ms),
            "retireMs": judge.rules.retire_ms,
            "forgetMs": judge.rules.forget_ms,
            "retirementJudged": retire_after.is_some(),
        },
        "cells": listed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_fields_are_checked() {
        let good = |internal: Option<&str>| {
            check_cell_fields(1, "c7", "wss://c7.example", "eu", 5, internal).is_ok()
        };
        assert!(good(None));
        assert!(good(Some("http://10.0.0.7:8081")));
        assert!(!good(Some("ws://10.0.0.7:8081")));
        let reason = |result: Result<(), Reply>| result.unwrap_err().body;
        assert!(
            reason(check_cell_fields(2, "c7", "wss://x", "eu", 5, None)).contains("v must be 1")
        );
        assert!(reason(check_cell_fields(1, "c 7", "wss://x", "eu", 5, None)).contains("cellId"));
        assert!(reason(check_cell_fields(1, "c7", "http://x", "eu", 5, None)).contains("cellUrl"));
        assert!(reason(check_cell_fields(1, "c7", "wss://x", "", 5, None)).contains("region"));
        assert!(
            reason(check_cell_fields(1, "c7", "wss://x", "eu", -1, None)).contains("incarnation")
        );
    }

    #[test]
    fn the_listing_is_version_1_with_membership_and_what_the_poller_saw() {
        use crate::director::feed_poller::Lane;
        use crate::director::membership::Rules;
        use crate::director::placement::FeedView;
        use crate::store::{AdmitEffective, CellRuntime};

        let cell = |id: &str, silent: i64| CellRow {
            cell_id: id.into(),
            cell_url: format!("wss://{id}"),
            internal_url: Some(format!("http://{id}:8081")),
            region: "eu".into(),
            incarnation: 7,
            registered_at: 1_000,
            registered_age_ms: 90_000_000,
            runtime: Some(CellRuntime {
                cell_incarnation: 7,
                started_at: 900,
                ready: true,
                connections: 3,
                last_heartbeat_at: 2_000,
                heartbeat_age_ms: silent,
            }),
            admit_mode: "reserve".into(),
            admit_mode_updated_at: Some(500),
            effective: Some(AdmitEffective {
                cell_incarnation: 7,
                mode: "reserve".into(),
                updated_at: 1_500,
                age_ms: 4_000,
            }),
        };
        let view = |draining: bool| FeedView {
            incarnation: 7,
            admit_mode_raw: "reserve".into(),
            admit_mode_effective: "reserve".into(),
            draining,
            seated: 2,
            bookings: 1,
            connections: 3,
            last_success_ms: 9_500,
        };
        let cells = [
            cell("a", 1_000),
            cell("b", 1_000),
            cell("c", 700_000),
            cell("d", 1_000),
        ];
        let feeds = HashMap::from([
            (
                "a".to_string(),
                FeedStatus {
                    view: Some(view(false)),
                    consecutive_failures: 0,
                    lane: Lane::Live,
                },
            ),
            (
                "b".to_string(),
                FeedStatus {
                    view: Some(view(true)),
                    consecutive_failures: 0,
                    lane: Lane::Live,
                },
            ),
            (
                "c".to_string(),
                FeedStatus {
                    view: None,
                    consecutive_failures: 12,
                    lane: Lane::Suspect,
                },
            ),
        ]);
        let judge = Judge {
            rules: Rules {
                retire_ms: 600_000,
                forget_ms: 86_400_000,
            },
            started_monotonic_ms: 0,
        };
        let listing = fleet_listing(&cells, &feeds, &judge, 700_000, 10_000);
        assert_eq!(listing["v"], 1);
        assert_eq!(
            listing["director"],
            json!({"uptimeMs": 700_000, "retireMs": 600_000, "forgetMs": 86_400_000,
                   "retirementJudged": true})
        );
        let listed = listing["cells"].as_array().unwrap();
        assert_eq!(
            listed[0],
            json!({
                "cellId": "a", "state": "live", "ready": true, "region": "eu",
                "cellUrl": "wss://a", "internalUrl": "http://a:8081", "incarnation": 7,
                "registeredAt": 1_000, "silentMs": 1_000,
                "heartbeat": {"incarnation": 7, "startedAt": 900, "ageMs": 1_000,
                              "ready": true, "connections": 3},
                "admitMode": {"mode": "reserve", "updatedAt": 500},
                "admitEffective": {"mode": "reserve", "incarnation": 7, "ageMs": 4_000},
                "feed": {"lane": "live", "consecutiveFailures": 0, "lastSuccessAgeMs": 500,
                         "incarnation": 7, "admitModeRaw": "reserve",
                         "admitModeEffective": "reserve", "draining": false,
                         "counts": {"seated": 2, "bookings": 1, "connections": 3}},
            })
        );
        assert_eq!(listed[1]["state"], "draining");
        assert_eq!(listed[2]["state"], "retired");
        assert_eq!(listed[2]["feed"]["lane"], "none");
        assert_eq!(listed[2]["feed"]["consecutiveFailures"], 12);
        assert_eq!(listed[2]["feed"]["lastSuccessAgeMs"], Value::Null);
        assert_eq!(listed[3]["feed"], Value::Null, "never polled");
        // Before the director has been up RETIRE_MS, the silent cell is not retired.
        let early = fleet_listing(&cells, &feeds, &judge, 1_000, 10_000);
        assert_eq!(early["director"]["retirementJudged"], false);
        assert_eq!(early["cells"][2]["state"], "live");
    }
}
