//! `POST /v1/assign` (SPEC §6.2): which cell, at which epoch, for a desktop.
//!
//! Runs on an HTTP worker. The desktop's JWT is verified; `relayHostId` must equal its claim.
//! A placement mints a new epoch (the highest known + 1) and writes the placement row only if
//! that epoch is strictly higher than the stored one, so two directors racing for one host
//! never leave two rows at one epoch: the loser re-reads and tries again.

use serde::Deserialize;

use crate::auth::Verifier;
use crate::clock::SharedClock;
use crate::http::{Reply, Request};
use crate::store::Store;

/// Public bodies over 4 KiB are refused (SPEC §5.4).
pub const ASSIGN_BODY_LIMIT: usize = 4 * 1024;
/// How often a placement retries after losing a race for the same host.
const PLACEMENT_ATTEMPTS: u32 = 5;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AssignBody {
    v: u32,
    relay_host_id: String,
    #[serde(default)]
    #[allow(dead_code)]
    reconnect: Option<bool>,
}

/// The cell a placement lands on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub cell_id: String,
    pub cell_url: String,
}

pub struct AssignContext {
    pub verifier: Verifier,
    pub store: Store,
    pub clock: SharedClock,
    /// The combined role places every host on its own cell.
    pub local_cell: Target,
}

pub fn handle(request: &mut Request<'_>, context: &AssignContext) -> Reply {
    let claims = match crate::auth::parse_bearer(request.authorization)
        .and_then(|token| context.verifier.verify_host_token(token))
    {
        Ok(claims) => claims,
        Err(e) => {
            return Reply::json(
                401,
                serde_json::json!({"error": "unauthorized", "reason": e.reason_code()}).to_string(),
            )
        }
    };
    let body: AssignBody = match request.json(ASSIGN_BODY_LIMIT) {
        Ok(body) => body,
        Err(reply) => return reply,
    };
    if body.v != 1 {
        return Reply::json(
            400,
            serde_json::json!({"error": "bad_request", "reason": "v must be 1"}).to_string(),
        );
    }
    if body.relay_host_id != claims.relay_host_id {
        return Reply::error(403, "relay_host_id_mismatch");
    }
    match place(
        context,
        &claims.user_id,
        &claims.relay_host_id,
        &context.local_cell,
    ) {
        Ok(epoch) => Reply::json(
            200,
            serde_json::json!({
                "v": 1,
                "cellUrl": context.local_cell.cell_url,
                "assignmentEpoch": epoch,
            })
            .to_string(),
        ),
        Err(reply) => reply,
    }
}

/// Writes a placement at a new epoch; returns the epoch.
pub fn place(
    context: &AssignContext,
    user_id: &str,
    relay_host_id: &str,
    target: &Target,
) -> Result<i64, Reply> {
    let unavailable = |e: crate::store::StoreError| {
        log::warn!(
            "orca_relay_assign_store_failed host={relay_host_id} reason={}",
            e.reason_code()
        );
        Reply::error(503, "relay_store_unavailable").with_header("Retry-After", "2")
    };
    for _ in 0..PLACEMENT_ATTEMPTS {
        let current = context
            .store
            .assignment(user_id, relay_host_id)
            .map_err(unavailable)?;
        let epoch = current.map(|row| row.epoch).unwrap_or(0) + 1;
        let now = context.clock.now_ms() as i64;
        let written = context
            .store
            .place_assignment_if_newer(user_id, relay_host_id, &target.cell_id, epoch, now)
            .map_err(unavailable)?;
        if written {
            log::info!(
                "orca_relay_host_placed host={relay_host_id} cell_id={} epoch={epoch}",
                target.cell_id
            );
            return Ok(epoch);
        }
    }
    Err(Reply::error(503, "relay_placement_contended").with_header("Retry-After", "1"))
}
