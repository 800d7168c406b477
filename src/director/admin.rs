//! The director's admin API (SPEC §6.2), behind `Authorization: Bearer $SERVICE_TOKEN`:
//! - `POST /v1/admin/cells/register`: a cell's startup registration (SPEC §8);
//! - `POST /v1/admin/cell-heartbeat`: a cell's heartbeat (SPEC §5.6), the receiving side;
//! - `PUT /v1/admin/cell-admit-mode`: the operator's record of a cell's switch.
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
//!   The heartbeat may carry `internalUrl`; without one, the cell is placed on the database
//!   path only until it registers with one.

use std::collections::HashMap;
use std::sync::Mutex;

use serde::Deserialize;
use serde_json::json;

use crate::clock::SharedClock;
use crate::config::is_id;
use crate::http::{BodyError, Reply, Request};
use crate::metrics::Registry;
use crate::service_token::ServiceTokens;
use crate::store::{HeartbeatOutcome, Store, StoreError, MODE_DB, MODE_RESERVE};

/// Largest admin body (SPEC §5.4, the same limit as the cell's internal API).
pub const ADMIN_BODY_LIMIT: usize = 16 * 1024;
/// Longest URL or region label accepted.
const MAX_TEXT_LEN: usize = 2_048;

pub const REGISTER_PATH: &str = "/v1/admin/cells/register";
pub const HEARTBEAT_PATH: &str = "/v1/admin/cell-heartbeat";
pub const ADMIT_MODE_PATH: &str = "/v1/admin/cell-admit-mode";

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
    /// Cells known to be registered, with the incarnation seen: spares a heartbeat the
    /// existence check. Filled by registrations and by the first heartbeat of each cell.
    known: Mutex<HashMap<String, i64>>,
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
    ) -> AdminContext {
        AdminContext {
            store,
            clock,
            service_tokens,
            registry: registry.clone(),
            known: Mutex::new(HashMap::new()),
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
            (REGISTER_PATH | HEARTBEAT_PATH, _) => {
                Reply::error(405, "method_not_allowed").with_header("Allow", "POST")
            }
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

    fn remember(&self, cell_id: &str, incarnation: i64) {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        let entry = known.entry(cell_id.to_string()).or_insert(incarnation);
        *entry = (*entry).max(incarnation);
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
        let now = self.clock.now_ms() as i64;
        if let Err(e) = self.store.register_cell(
            &body.cell_id,
            &body.cell_url,
            body.internal_url.as_deref().unwrap_or(""),
            &body.region,
            body.incarnation,
            now,
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
                self.remember(&body.cell_id, body.incarnation);
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
        let now = self.clock.now_ms() as i64;
        let known = self
            .known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&body.cell_id);
        if !known {
            match self.stored_incarnation(&body.cell_id) {
                Ok(Some(stored)) => self.remember(&body.cell_id, stored),
                Ok(None) => {
                    if let Err(e) = self.store.register_cell(
                        &body.cell_id,
                        &body.cell_url,
                        body.internal_url.as_deref().unwrap_or(""),
                        &body.region,
                        body.incarnation,
                        now,
                    ) {
                        return self.store_failed("heartbeat", &e);
                    }
                    self.remember(&body.cell_id, body.incarnation);
                    log::info!(
                        "orca_relay_director_cell_registered_by_heartbeat cell_id={} incarnation={}",
                        body.cell_id,
                        body.incarnation
                    );
                }
                Err(e) => return self.store_failed("heartbeat", &e),
            }
        }
        match self.store.heartbeat(
            &body.cell_id,
            body.incarnation,
            body.started_at,
            body.ready,
            body.connections,
            now,
        ) {
            Ok(HeartbeatOutcome::Accepted) => ok(),
            Ok(HeartbeatOutcome::StaleIncarnation) => {
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
        let now = self.clock.now_ms() as i64;
        match self
            .store
            .set_admit_mode(&body.cell_id, &body.admit_mode, now)
        {
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
}
