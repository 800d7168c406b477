//! The director's admin API (SPEC §6.2), behind `Authorization: Bearer $SERVICE_TOKEN`:
//! - `POST /v1/admin/cells/register`: a cell's startup registration (SPEC §8);
//! - `POST /v1/admin/cell-heartbeat`: a cell's heartbeat (SPEC §5.6), the receiving side;
//! - `PUT /v1/admin/cell-admit-mode`: the operator's record of a cell's switch;
//! - `POST /v1/admin/cells/deregister` `{"v":1,"cellId","incarnation"}`: a draining cell's
//!   clean exit (SPEC §11): its registration and runtime row go at once, so the feed poller
//!   stops polling it and placement forgets it without waiting for it to retire;
//! - `GET /v1/admin/cells`: every cell this director knows, with its membership (live,
//!   draining, retired), what the database and the feed poller say about it, the cell's own
//!   status report (from its feed or its heartbeat), whether it holds a trip slot, and a
//!   fleet summary ([`fleet_listing`], `{"v":1,…}`; `orca-relay fleet status` reads it).
//!
//! The combined role serves only the listing ([`AdminContext::listing_only`]): its cell is
//! in-process, so registration and heartbeats have no caller. Without a configured
//! `ORCA_RELAY_SERVICE_TOKEN` it answers 401 `service_token_not_configured`, since nobody
//! outside the process knows the token it generated.
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
//! - A heartbeat of the registered incarnation also makes the registration say what the cell
//!   advertises now (`cellUrl`, `region`, `internalUrl`; written only when they differ,
//!   `orca_relay_director_cell_advertised`): a live handover applies a changed URL without
//!   registering again (SPEC §13), and placement must hand out what the cell serves.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{json, Value};

use super::feed_poller::{FeedBoard, FeedStatus, SeenCell, Sign};
use super::membership::{self, Judge, Membership};
use crate::cell::status_report::{DeadManReport, StatusReport};
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
    /// The cell's status report (`cell::status_report`), read on its own: a report this
    /// director cannot read is dropped, the heartbeat is still recorded.
    #[serde(default)]
    status: Option<Value>,
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
    /// `ORCA_RELAY_TRIP_SLOT_STALE_MS`: an admit-effective `db` row older than this no longer
    /// holds a trip slot (what the claim counts, `store::claim`).
    trip_slot_stale_ms: u64,
    routes: AdminRoutes,
    /// Refused requests (no or a wrong service token) are counted per request
    /// (`orca_relay_director_admin_requests_total{status="401"}`) but logged through one
    /// throttle: the first, then at most one line a minute with a count.
    refusals: crate::logging::SharedThrottle,
    /// Requests the store failed (a database outage fails every heartbeat and registration):
    /// the first logged, then at most one line a minute with a count, then one on recovery.
    store_failures: crate::logging::SharedThrottle,
}

/// Which admin routes this process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AdminRoutes {
    /// The director role: the whole admin API.
    All,
    /// The combined role: only `GET /v1/admin/cells`; `token_configured` says whether the
    /// operator set `ORCA_RELAY_SERVICE_TOKEN` (else the process generated one nobody knows).
    ListingOnly { token_configured: bool },
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
        trip_slot_stale_ms: u64,
    ) -> AdminContext {
        AdminContext {
            store,
            clock,
            service_tokens,
            registry: registry.clone(),
            board,
            membership,
            trip_slot_stale_ms,
            routes: AdminRoutes::All,
            refusals: crate::logging::SharedThrottle::new(),
            store_failures: crate::logging::SharedThrottle::new(),
        }
    }

    /// The combined role's admin API: `GET /v1/admin/cells` only (any other `/v1/admin/` path
    /// is not answered here). `token_configured`: `ORCA_RELAY_SERVICE_TOKEN` was set; without
    /// it the listing answers 401 `service_token_not_configured`.
    pub fn listing_only(mut self, token_configured: bool) -> AdminContext {
        self.routes = AdminRoutes::ListingOnly { token_configured };
        self
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
        if let AdminRoutes::ListingOnly { token_configured } = self.routes {
            if path != CELLS_PATH {
                return None;
            }
            if !token_configured {
                self.count("cells", 401);
                return Some(Reply::error(401, "service_token_not_configured"));
            }
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
            if let Some(note) = self.refusals.failure(self.clock.now_ms()) {
                log::warn!(
                    "orca_relay_director_admin_unauthorized path={} token={}{note}",
                    request.path,
                    if request.authorization.is_some() {
                        "wrong"
                    } else {
                        "missing"
                    }
                );
            }
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

    /// A request the store failed: 503, and a line through the throttle (one per outage, then
    /// one a minute with a count).
    fn store_failed(&self, what: &str, error: &StoreError) -> Reply {
        if let Some(note) = self.store_failures.failure(self.clock.now_ms()) {
            log::warn!(
                "orca_relay_director_admin_store_failed action={what} {}{note}",
                error.log_fields()
            );
        }
        Reply::error(503, "relay_store_unavailable").with_header("Retry-After", "2")
    }

    /// The store answered a request: ends a run of failures with one line.
    fn store_answered(&self) {
        if let Some(note) = self.store_failures.success() {
            log::info!("orca_relay_director_admin_store_recovered{note}");
        }
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
        self.store_answered();
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
                // A sign of life: a cell the feed poller was backing off is polled at once.
                self.board
                    .heard_from(&body.cell_id, Sign::Registration, self.clock.monotonic_ms());
                // Polled from the next round even if the database stops before it can list it.
                self.board.saw_registered(
                    SeenCell {
                        cell_id: body.cell_id.clone(),
                        cell_url: body.cell_url.clone(),
                        internal_url: body.internal_url.clone().unwrap_or_default(),
                        region: body.region.clone(),
                        incarnation: body.incarnation,
                    },
                    self.clock.monotonic_ms(),
                );
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
        // The beat also carries what the cell advertises (its URL, region, internal URL): a
        // live handover applies a changed one without registering again, and the registration
        // follows it here, so placement hands out what the cell serves.
        let advertised = crate::store::Advertised {
            cell_url: &body.cell_url,
            region: &body.region,
            internal_url: body.internal_url.as_deref(),
        };
        let record = || {
            let (outcome, changed) = self.store.heartbeat_advertised(
                &body.cell_id,
                body.incarnation,
                body.started_at,
                body.ready,
                body.connections,
                advertised,
            )?;
            if changed {
                log::info!(
                    "orca_relay_director_cell_advertised cell_id={} incarnation={} cell_url={} internal_url={} region={}",
                    body.cell_id,
                    body.incarnation,
                    body.cell_url,
                    body.internal_url.as_deref().unwrap_or("-"),
                    body.region
                );
            }
            Ok(outcome)
        };
        let outcome = record().and_then(|outcome| match outcome {
            HeartbeatOutcome::Unregistered => {
                // This incarnation is not registered (never, forgotten, or its registration
                // lost with the database's last writes): the heartbeat registers it.
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
        if outcome.is_ok() {
            self.store_answered();
        }
        match outcome {
            Ok(HeartbeatOutcome::Accepted) => {
                // A sign of life: the feed poller ends the cell's backoff and polls it within
                // a period (SPEC §12), whatever its polls did so far.
                self.board
                    .heard_from(&body.cell_id, Sign::Heartbeat, self.clock.monotonic_ms());
                self.board.saw_registered(
                    SeenCell {
                        cell_id: body.cell_id.clone(),
                        cell_url: body.cell_url.clone(),
                        internal_url: body.internal_url.clone().unwrap_or_default(),
                        region: body.region.clone(),
                        incarnation: body.incarnation,
                    },
                    self.clock.monotonic_ms(),
                );
                if let Some(report) = body
                    .status
                    .and_then(|status| serde_json::from_value::<StatusReport>(status).ok())
                {
                    self.board.record_report(
                        &body.cell_id,
                        body.incarnation,
                        report,
                        self.clock.now_ms(),
                    );
                }
                ok()
            }
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
                self.store_answered();
                self.board.deregistered(&body.cell_id, body.incarnation);
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
                self.store_answered();
                let listing = fleet_listing(
                    &cells,
                    &self.board.status(),
                    &self.membership,
                    ListingClock {
                        monotonic_now_ms: self.clock.monotonic_ms(),
                        now_ms: self.clock.now_ms(),
                    },
                    self.trip_slot_stale_ms,
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
                self.store_answered();
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

/// The director's clocks for one listing: the monotonic one judges membership against its own
/// uptime, the wall one ages what this director stamped (feed answers, reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListingClock {
    pub monotonic_now_ms: u64,
    pub now_ms: u64,
}

/// Whether `cell` holds a trip slot, judged the way the claim counts (`store::claim`): its
/// admit-effective row says `db`, the operator's record says `reserve`, and the row was
/// refreshed within `TRIP_SLOT_STALE_MS` (database clock). A cell on an older image, or one
/// without a cap, takes a slot this way too.
pub fn holds_trip_slot(cell: &CellRow, trip_slot_stale_ms: u64) -> bool {
    cell.admit_mode == MODE_RESERVE
        && cell.effective.as_ref().is_some_and(|effective| {
            effective.mode == MODE_DB
                && effective.age_ms <= i64::try_from(trip_slot_stale_ms).unwrap_or(i64::MAX)
        })
}

/// `GET /v1/admin/cells`, version 1: every registered cell, ordered by id, and a `summary`. Ages
/// are the database's (`…AgeMs`), except the feed's and the status report's, which are this
/// director's own. A field this director has no data for is `null`. Documented in
/// docs/OPERATIONS.md ("The fleet listing", "Reading fleet status").
pub fn fleet_listing(
    cells: &[CellRow],
    feeds: &HashMap<String, FeedStatus>,
    judge: &Judge,
    clock: ListingClock,
    trip_slot_stale_ms: u64,
) -> Value {
    let ListingClock {
        monotonic_now_ms,
        now_ms,
    } = clock;
    let retire_after = judge.retire_after(monotonic_now_ms);
    let mut summary = Summary::default();
    let listed: Vec<Value> = cells
        .iter()
        .map(|cell| {
            let feed = feeds.get(&cell.cell_id);
            let view = feed.and_then(|feed| feed.view.as_ref());
            let draining = view
                .is_some_and(|view| view.draining && view.incarnation == cell.incarnation);
            let state = membership::membership(cell, draining, retire_after);
            // Only the running incarnation's report: a restarted cell's old one is not it.
            let received = feed
                .and_then(|feed| feed.report.as_ref())
                .filter(|received| received.incarnation == cell.incarnation);
            let holds_slot = holds_trip_slot(cell, trip_slot_stale_ms);
            let ready = cell.runtime.as_ref().map(|runtime| runtime.ready);
            summary.count(
                state,
                ready,
                received.map(|received| &received.report),
                holds_slot,
            );
            json!({
                "cellId": cell.cell_id,
                "state": state.as_str(),
                "ready": ready,
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
                "holdsTripSlot": holds_slot,
                "feed": feed.map(|feed| json!({
                    "lane": if state == Membership::Retired {
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
                "status": received.map(|received| {
                    let mut status = serde_json::to_value(&received.report).unwrap_or(Value::Null);
                    if let Value::Object(fields) = &mut status {
                        fields.insert("source".into(), received.source.as_str().into());
                        fields.insert(
                            "ageMs".into(),
                            now_ms.saturating_sub(received.received_ms).into(),
                        );
                    }
                    status
                }),
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
            "tripSlotStaleMs": trip_slot_stale_ms,
        },
        "cells": listed,
        "summary": summary.to_json(),
    })
}

/// The listing's `summary`: cells by membership, live cells ready, cells by dead-man state
/// (retired cells, whose last report is old, are counted by membership only), slots taken and
/// the fleet's slot count.
#[derive(Debug, Default)]
struct Summary {
    cells: u64,
    live: u64,
    draining: u64,
    retired: u64,
    ready: u64,
    off: u64,
    armed: u64,
    held: u64,
    tripped: u64,
    unknown: u64,
    slots_taken: u64,
    /// The largest `deadManTripSlots` in force on a cell that is not retired: with mixed values
    /// the effective cap is the largest (SPEC §5.5); `None` when no such cell has a cap.
    slots: Option<u32>,
}

impl Summary {
    fn count(
        &mut self,
        state: Membership,
        ready: Option<bool>,
        report: Option<&StatusReport>,
        holds_slot: bool,
    ) {
        self.cells += 1;
        self.slots_taken += u64::from(holds_slot);
        match state {
            Membership::Live => self.live += 1,
            Membership::Draining => self.draining += 1,
            Membership::Retired => {
                self.retired += 1;
                return;
            }
        }
        if state == Membership::Live && ready == Some(true) {
            self.ready += 1;
        }
        let dead_man = report.map_or(DeadManReport::Unknown, |report| report.dead_man);
        *match dead_man {
            DeadManReport::Off => &mut self.off,
            DeadManReport::Armed => &mut self.armed,
            DeadManReport::Held => &mut self.held,
            DeadManReport::Tripped => &mut self.tripped,
            DeadManReport::Unknown => &mut self.unknown,
        } += 1;
        if let Some(slots) = report.and_then(|report| report.trip_slots) {
            self.slots = Some(self.slots.map_or(slots, |known| known.max(slots)));
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "cells": self.cells,
            "byState": {"live": self.live, "draining": self.draining, "retired": self.retired},
            "ready": self.ready,
            "byDeadMan": {
                "off": self.off, "armed": self.armed, "held": self.held,
                "tripped": self.tripped, "unknown": self.unknown,
            },
            "slotsTaken": self.slots_taken,
            "slots": self.slots,
        })
    }
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
                    report: None,
                },
            ),
            (
                "b".to_string(),
                FeedStatus {
                    view: Some(view(true)),
                    consecutive_failures: 0,
                    lane: Lane::Live,
                    report: None,
                },
            ),
            (
                "c".to_string(),
                FeedStatus {
                    view: None,
                    consecutive_failures: 12,
                    lane: Lane::Suspect,
                    report: None,
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
        let at = |monotonic_now_ms| ListingClock {
            monotonic_now_ms,
            now_ms: 10_000,
        };
        let listing = fleet_listing(&cells, &feeds, &judge, at(700_000), 600_000);
        assert_eq!(listing["v"], 1);
        assert_eq!(
            listing["director"],
            json!({"uptimeMs": 700_000, "retireMs": 600_000, "forgetMs": 86_400_000,
                   "retirementJudged": true, "tripSlotStaleMs": 600_000})
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
                "holdsTripSlot": false,
                "status": null,
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
        let early = fleet_listing(&cells, &feeds, &judge, at(1_000), 600_000);
        assert_eq!(early["director"]["retirementJudged"], false);
        assert_eq!(early["cells"][2]["state"], "live");
    }

    #[test]
    fn the_listing_shows_each_cells_report_and_sums_up_states_and_slots() {
        use crate::cell::status_report::StatusReport;
        use crate::director::feed_poller::{Lane, ReceivedReport, ReportSource};
        use crate::director::membership::Rules;
        use crate::store::AdmitEffective;

        // (id, silent ms, operator's record, effective row (mode, age), dead-man, slots)
        let cell = |id: &str, silent: i64, record: &str, row: Option<(&str, i64)>| CellRow {
            cell_id: id.into(),
            cell_url: format!("wss://{id}"),
            internal_url: Some(format!("http://{id}")),
            region: "eu".into(),
            incarnation: 7,
            registered_at: 1_000,
            registered_age_ms: silent,
            runtime: None,
            admit_mode: record.into(),
            admit_mode_updated_at: None,
            effective: row.map(|(mode, age_ms)| AdmitEffective {
                cell_incarnation: 7,
                mode: mode.into(),
                updated_at: 0,
                age_ms,
            }),
        };
        let cells = [
            cell("armed", 100, "reserve", Some(("reserve", 100))),
            cell("held", 100, "reserve", Some(("reserve", 100))),
            cell("tripped", 100, "reserve", Some(("db", 100))),
            cell("stale-db", 100, "reserve", Some(("db", 700_000))),
            cell("db-flip", 100, "db", Some(("db", 100))),
            cell("old-image", 100, "reserve", Some(("db", 100))),
            cell("gone", 900_000, "reserve", Some(("reserve", 100))),
        ];
        let report = |dead_man, slots: Option<u32>, incarnation, received_ms| FeedStatus {
            view: None,
            consecutive_failures: 0,
            lane: Lane::Live,
            report: Some(ReceivedReport {
                report: StatusReport {
                    dead_man,
                    window_ms: 90_000,
                    window_left_ms: Some(if dead_man == DeadManReport::Armed {
                        42_000
                    } else {
                        0
                    }),
                    trip_slots: slots,
                    ..StatusReport::default()
                },
                incarnation,
                source: ReportSource::Heartbeat,
                received_ms,
            }),
        };
        let feeds = HashMap::from([
            (
                "armed".to_string(),
                report(DeadManReport::Armed, Some(2), 7, 9_000),
            ),
            (
                "held".to_string(),
                report(DeadManReport::Held, Some(2), 7, 9_500),
            ),
            (
                "tripped".to_string(),
                report(DeadManReport::Tripped, Some(2), 7, 9_800),
            ),
            (
                "stale-db".to_string(),
                report(DeadManReport::Off, None, 6, 9_000),
            ),
            (
                "db-flip".to_string(),
                report(DeadManReport::Off, None, 7, 9_000),
            ),
            (
                "gone".to_string(),
                report(DeadManReport::Armed, Some(9), 7, 1_000),
            ),
        ]);
        let judge = Judge {
            rules: Rules {
                retire_ms: 600_000,
                forget_ms: 86_400_000,
            },
            started_monotonic_ms: 0,
        };
        let clock = ListingClock {
            monotonic_now_ms: 700_000,
            now_ms: 10_000,
        };
        let listing = fleet_listing(&cells, &feeds, &judge, clock, 600_000);
        let by_id = |id: &str| {
            listing["cells"]
                .as_array()
                .unwrap()
                .iter()
                .find(|cell| cell["cellId"] == id)
                .unwrap()
                .clone()
        };
        let held = by_id("held");
        assert_eq!(held["status"]["deadMan"], "held");
        assert_eq!(held["status"]["source"], "heartbeat");
        assert_eq!(held["status"]["ageMs"], 500, "the director's own clock");
        assert_eq!(by_id("armed")["status"]["windowLeftMs"], 42_000);
        assert_eq!(
            by_id("stale-db")["status"],
            Value::Null,
            "a report of an earlier incarnation is not this process's"
        );
        assert_eq!(by_id("old-image")["status"], Value::Null, "no report");
        let holders: Vec<&str> = [
            "armed",
            "held",
            "tripped",
            "stale-db",
            "db-flip",
            "old-image",
            "gone",
        ]
        .into_iter()
        .filter(|id| by_id(id)["holdsTripSlot"] == true)
        .collect();
        assert_eq!(
            holders,
            ["tripped", "old-image"],
            "what the claim counts: a fresh db row of a cell recorded reserve"
        );
        assert_eq!(
            listing["summary"],
            json!({
                "cells": 7,
                "byState": {"live": 6, "draining": 0, "retired": 1},
                "ready": 0,
                "byDeadMan": {"off": 1, "armed": 1, "held": 1, "tripped": 1, "unknown": 2},
                "slotsTaken": 2,
                "slots": 2,
            }),
            "the retired cell's old cap of 9 is not the fleet's"
        );
        let none = fleet_listing(&cells[4..5], &feeds, &judge, clock, 600_000);
        assert_eq!(none["summary"]["slots"], Value::Null, "no cap anywhere");
    }
}
