//! `POST /v1/assign` (SPEC §6.2): which cell, at which epoch, for a desktop.
//!
//! Runs on an HTTP worker. The desktop's JWT is verified; `relayHostId` must equal its claim
//! (else 403). The decision is [`super::placement::decide`]; this module reads its inputs (the
//! placement row, the cells, the feed board) and applies it:
//! - pin → answer the row, write nothing;
//! - place → write the row at the new epoch with `place_assignment_if_newer` (only a strictly
//!   higher epoch replaces a row, so of two directors placing one host at one epoch exactly one
//!   writes it; the other re-reads and decides again). For a booking candidate, the seat is
//!   booked through the cell's `/internal/reserve` *after* the row is written, at exactly that
//!   epoch. A booking anything but `ok` moves on to the next candidate at a **new** epoch: an
//!   epoch is never offered to two cells, and a booking is only ever made for an epoch this
//!   request wrote, so no epoch is booked twice.
//!
//! Must never: hold a lock across the database or a cell call, reuse an epoch on another cell,
//! or answer a placement whose row write it lost.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;

use super::feed_poller::{FeedBoard, POLL_TIMEOUT};
use super::membership::Judge;
use super::placement::{self, Candidate, Decision, Params, Path, Rng};
use crate::auth::Verifier;
use crate::cell::mode::CellMode;
use crate::clock::SharedClock;
use crate::http::{Reply, Request};
use crate::metrics::{Counter, Registry};
use crate::service_token::ServiceTokens;
use crate::store::{CellRow, Store, StoreError};

/// Public bodies over 4 KiB are refused (SPEC §5.4).
pub const ASSIGN_BODY_LIMIT: usize = 4 * 1024;
/// Rounds of one request: each lost race or refused booking costs one.
const PLACEMENT_ROUNDS: u32 = 8;
/// A booking lives this long unless the desktop consumes it (SPEC §5.4 caps it at 30 s).
pub const BOOKING_TTL_MS: u64 = 30_000;
/// Timeout of one `/internal/reserve` call.
pub const RESERVE_TIMEOUT: Duration = Duration::from_secs(2);
/// `Retry-After` of every 503 here, in seconds.
const RETRY_AFTER_S: &str = "2";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AssignBody {
    v: u32,
    relay_host_id: String,
    #[serde(default)]
    #[allow(dead_code)] // accepted for the desktop's sake; placement does not depend on it
    reconnect: Option<bool>,
}

/// The cell a placement lands on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub cell_id: String,
    pub cell_url: String,
}

/// One booking, as `/internal/reserve` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booking<'a> {
    pub director_id: &'a str,
    pub user_id: &'a str,
    pub relay_host_id: &'a str,
    pub epoch: i64,
    pub ttl_ms: u64,
}

/// A cell's answer to one booking (SPEC §5.4 outcomes), or why there was none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    Ok,
    Full,
    Draining,
    Off,
    SeatedNewer {
        epoch: Option<i64>,
    },
    /// No usable answer: transport failure, timeout, non-2xx, malformed body.
    Failed(String),
}

impl ReserveOutcome {
    pub fn as_str(&self) -> &'static str {
        match self {
            ReserveOutcome::Ok => "ok",
            ReserveOutcome::Full => "full",
            ReserveOutcome::Draining => "draining",
            ReserveOutcome::Off => "off",
            ReserveOutcome::SeatedNewer { .. } => "seated-newer",
            ReserveOutcome::Failed(_) => "failed",
        }
    }
}

/// How the director books seats on cells. The director role and the combined role both use
/// [`HttpCellClient`] (the combined role calls its own HTTP listener); tests may fake it.
pub trait CellClient: Send + Sync {
    /// Books one seat on the cell whose HTTP listener is at `internal_url`.
    fn reserve(&self, internal_url: &str, booking: &Booking<'_>) -> ReserveOutcome;
}

/// `POST <internal_url>/internal/reserve` with the service token and a 2 s timeout.
pub struct HttpCellClient {
    agent: ureq::Agent,
    service_token: ServiceTokens,
}

impl HttpCellClient {
    pub fn new(service_token: ServiceTokens) -> HttpCellClient {
        HttpCellClient {
            agent: ureq::AgentBuilder::new().timeout(RESERVE_TIMEOUT).build(),
            service_token,
        }
    }
}

impl CellClient for HttpCellClient {
    fn reserve(&self, internal_url: &str, booking: &Booking<'_>) -> ReserveOutcome {
        let url = format!("{}/internal/reserve", internal_url.trim_end_matches('/'));
        let body = json!({
            "v": 1,
            "directorId": booking.director_id,
            "items": [{
                "userId": booking.user_id,
                "relayHostId": booking.relay_host_id,
                "epoch": booking.epoch,
                "ttlMs": booking.ttl_ms,
            }],
        });
        let response = self
            .service_token
            .call_http(internal_url, RESERVE_TIMEOUT, |token, left| {
                self.agent
                    .post(&url)
                    .timeout(left)
                    .set("Authorization", &format!("Bearer {token}"))
                    .send_json(body.clone())
                    .map_err(Box::new)
            })
            .map_err(|error| *error);
        match response {
            Ok(response) => match response.into_string() {
                Ok(text) => parse_reserve_answer(&text),
                Err(e) => ReserveOutcome::Failed(format!("unreadable answer: {e}")),
            },
            Err(ureq::Error::Status(status, _)) => {
                ReserveOutcome::Failed(format!("http status {status}"))
            }
            Err(ureq::Error::Transport(transport)) => {
                ReserveOutcome::Failed(format!("transport: {}", transport.kind()))
            }
        }
    }
}

/// Reads the first result of a `/internal/reserve` answer.
pub fn parse_reserve_answer(text: &str) -> ReserveOutcome {
    let value: serde_json::Value = match serde_json::from_str(text) {
        Ok(value) => value,
        Err(_) => return ReserveOutcome::Failed("answer is not JSON".into()),
    };
    let Some(first) = value
        .get("results")
        .and_then(|results| results.as_array())
        .and_then(|results| results.first())
    else {
        return ReserveOutcome::Failed("answer has no results".into());
    };
    match first.get("outcome").and_then(|outcome| outcome.as_str()) {
        Some("ok") => ReserveOutcome::Ok,
        Some("full") => ReserveOutcome::Full,
        Some("draining") => ReserveOutcome::Draining,
        Some("off") => ReserveOutcome::Off,
        Some("seated-newer") => ReserveOutcome::SeatedNewer {
            epoch: first.get("epoch").and_then(|epoch| epoch.as_i64()),
        },
        Some(other) => ReserveOutcome::Failed(format!("unknown outcome {other:?}")),
        None => ReserveOutcome::Failed("result has no outcome".into()),
    }
}

/// The fleet placement's moving parts.
pub struct Fleet {
    /// Names this director in `/internal/reserve` calls (`[A-Za-z0-9_-]`, ≤ 128).
    pub director_id: String,
    pub board: FeedBoard,
    pub cell_client: Arc<dyn CellClient>,
    /// `ORCA_RELAY_HEARTBEAT_FRESH_MS`.
    pub heartbeat_fresh_ms: u64,
    /// See [`placement::feed_fresh_ms`].
    pub feed_fresh_ms: u64,
    /// Which cells are retired (skipped).
    pub membership: Judge,
    pub rng: Mutex<Rng>,
    /// The combined role's own cell, whose drain this director knows of at once.
    pub in_process_cell: Option<InProcessCell>,
}

/// The cell that runs in the director's own process (the combined role). The feed poller
/// learns of its drain only with its next poll (up to `FEED_POLL_MS` later) and the store with
/// its next heartbeat; a desktop that follows the `drain` frame straight back to `/v1/assign`
/// must not be placed on it in between, so placement reads its drain from its [`CellMode`].
pub struct InProcessCell {
    pub cell_id: String,
    pub mode: Arc<CellMode>,
}

impl InProcessCell {
    /// Whether placement must leave this cell out now.
    fn is_draining(&self) -> bool {
        self.mode.is_draining()
    }
}

/// The cells placement may consider: all of them but the in-process cell while it drains
/// (neither a pin nor a candidate; with no other cell the answer is 503 with `Retry-After`).
fn placeable_cells(
    mut cells: Vec<CellRow>,
    in_process_cell: Option<&InProcessCell>,
) -> Vec<CellRow> {
    if let Some(local) = in_process_cell.filter(|local| local.is_draining()) {
        cells.retain(|cell| cell.cell_id != local.cell_id);
    }
    cells
}

impl Fleet {
    /// A fleet placement with the given cell client, freshness from `timings`.
    pub fn new(
        director_id: impl Into<String>,
        board: FeedBoard,
        cell_client: Arc<dyn CellClient>,
        timings: &crate::config::Timings,
        membership: Judge,
    ) -> Fleet {
        Fleet {
            director_id: director_id.into(),
            board,
            cell_client,
            heartbeat_fresh_ms: timings.heartbeat_fresh_ms,
            feed_fresh_ms: placement::feed_fresh_ms(
                timings.feed_poll_ms,
                POLL_TIMEOUT.as_millis() as u64,
            ),
            membership,
            rng: Mutex::new(Rng::from_os()),
            in_process_cell: None,
        }
    }

    /// The same placement for a director that runs `cell` in its own process.
    pub fn with_in_process_cell(mut self, cell: InProcessCell) -> Fleet {
        self.in_process_cell = Some(cell);
        self
    }

    /// Whether a new desktop could be placed on `cell_id` now: rule 2 of [`placement`] counts
    /// it a candidate, judged from `cells` (the store's rows) and this director's feed board as
    /// a placement would judge them. The combined role's `/ready` waits for this at start
    /// (`roles::process::ServeGate`), so its first 200 is never followed by a 503
    /// `relay_capacity_exhausted` for want of a heartbeat or a feed answer not yet recorded.
    pub fn places_on(
        &self,
        cells: &[CellRow],
        cell_id: &str,
        now_ms: u64,
        monotonic_ms: u64,
    ) -> bool {
        let params = Params {
            now_ms,
            heartbeat_fresh_ms: self.heartbeat_fresh_ms,
            feed_fresh_ms: self.feed_fresh_ms,
            retire_after_ms: self.membership.retire_after(monotonic_ms),
        };
        let feeds = self.board.snapshot();
        let cells = placeable_cells(cells.to_vec(), self.in_process_cell.as_ref());
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        placement::candidates(&cells, &feeds, &params, &[], &mut rng)
            .iter()
            .any(|candidate| candidate.cell_id == cell_id)
    }
}

/// Where placements go.
pub enum Placement {
    /// Every host on this one cell at a new epoch, written through the database path, with no
    /// pin, feed or booking. No role uses it any more (the combined role runs [`Fleet`] over
    /// its own cell); it remains for embedding a bare cell behind a trivial director.
    LocalCell(Target),
    /// The director's rules (SPEC §6.2) over the registered cells.
    Fleet(Fleet),
}

struct AssignMetrics {
    registry: Registry,
}

impl AssignMetrics {
    fn answer(&self, outcome: &str) -> Counter {
        self.registry.counter(
            "orca_relay_director_assign_total",
            "Answers to POST /v1/assign, by outcome.",
            &[("outcome", outcome)],
        )
    }

    fn reserve(&self, outcome: &str) -> Counter {
        self.registry.counter(
            "orca_relay_director_reserve_total",
            "Bookings asked of cells, by outcome.",
            &[("outcome", outcome)],
        )
    }
}

/// Everything `/v1/assign` needs; shared by the HTTP workers.
pub struct AssignContext {
    pub verifier: Verifier,
    pub store: Store,
    pub clock: SharedClock,
    pub placement: Placement,
    metrics: AssignMetrics,
    /// Requests the store failed (a database outage fails every one): the first logged, then
    /// at most one line a minute with a count, then one on recovery.
    store_failures: crate::logging::SharedThrottle,
}

impl AssignContext {
    pub fn new(
        verifier: Verifier,
        store: Store,
        clock: SharedClock,
        placement: Placement,
        registry: &Registry,
    ) -> AssignContext {
        AssignContext {
            verifier,
            store,
            clock,
            placement,
            metrics: AssignMetrics {
                registry: registry.clone(),
            },
            store_failures: crate::logging::SharedThrottle::new(),
        }
    }

    /// The store answered this request: ends a run of failures with one line.
    fn store_answered(&self) {
        if let Some(note) = self.store_failures.success() {
            log::info!("orca_relay_assign_store_recovered{note}");
        }
    }
}

fn ok_reply(cell_url: &str, epoch: i64) -> Reply {
    Reply::json(
        200,
        json!({"v": 1, "cellUrl": cell_url, "assignmentEpoch": epoch}).to_string(),
    )
}

fn unavailable(code: &str) -> Reply {
    Reply::error(503, code).with_header("Retry-After", RETRY_AFTER_S)
}

pub fn handle(request: &mut Request<'_>, context: &AssignContext) -> Reply {
    let reply = answer(request, context);
    let outcome = match reply.status {
        200 => "ok",
        400 => "bad_request",
        401 => "unauthorized",
        403 => "forbidden",
        413 => "too_large",
        _ => "unavailable",
    };
    context.metrics.answer(outcome).inc();
    reply
}

fn answer(request: &mut Request<'_>, context: &AssignContext) -> Reply {
    let claims = match crate::auth::parse_bearer(request.authorization)
        .and_then(|token| context.verifier.verify_host_token(token))
    {
        Ok(claims) => claims,
        Err(e) => {
            return Reply::json(
                401,
                json!({"error": "unauthorized", "reason": e.reason_code()}).to_string(),
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
            json!({"error": "bad_request", "reason": "v must be 1"}).to_string(),
        );
    }
    if body.relay_host_id != claims.relay_host_id {
        return Reply::error(403, "relay_host_id_mismatch");
    }
    let user_id = claims.user_id.as_str();
    let relay_host_id = claims.relay_host_id.as_str();
    let result = match &context.placement {
        Placement::LocalCell(target) => place_on(context, user_id, relay_host_id, target)
            .map(|epoch| ok_reply(&target.cell_url, epoch)),
        Placement::Fleet(fleet) => place_in_fleet(context, fleet, user_id, relay_host_id),
    };
    result.unwrap_or_else(|reply| reply)
}

/// The answer to a request the store failed, logged through the context's throttle (one line
/// per outage, then one a minute with a count).
fn store_unavailable<'a>(
    context: &'a AssignContext,
    relay_host_id: &'a str,
) -> impl Fn(StoreError) -> Reply + 'a {
    move |e: StoreError| {
        if let Some(note) = context.store_failures.failure(context.clock.now_ms()) {
            log::warn!(
                "orca_relay_assign_store_failed host={relay_host_id} {}{note}",
                e.log_fields()
            );
        }
        unavailable("relay_store_unavailable")
    }
}

/// Writes a placement on `target` at a new epoch; returns the epoch.
pub fn place_on(
    context: &AssignContext,
    user_id: &str,
    relay_host_id: &str,
    target: &Target,
) -> Result<i64, Reply> {
    let failed = store_unavailable(context, relay_host_id);
    for _ in 0..PLACEMENT_ROUNDS {
        let current = context
            .store
            .assignment(user_id, relay_host_id)
            .map_err(&failed)?;
        context.store_answered();
        let epoch = current.map(|row| row.epoch).unwrap_or(0) + 1;
        let now = context.clock.now_ms() as i64;
        let written = context
            .store
            .place_assignment_if_newer(user_id, relay_host_id, &target.cell_id, epoch, now)
            .map_err(&failed)?;
        if written {
            log::info!(
                "orca_relay_host_placed host={relay_host_id} cell_id={} epoch={epoch} path=database",
                target.cell_id
            );
            return Ok(epoch);
        }
    }
    Err(Reply::error(503, "relay_placement_contended").with_header("Retry-After", "1"))
}

/// The director's placement: decide, write, book; see the module header.
fn place_in_fleet(
    context: &AssignContext,
    fleet: &Fleet,
    user_id: &str,
    relay_host_id: &str,
) -> Result<Reply, Reply> {
    let failed = store_unavailable(context, relay_host_id);
    // The cells change on the scale of heartbeats; one read serves every round.
    let cells = placeable_cells(
        context.store.list_cells().map_err(&failed)?,
        fleet.in_process_cell.as_ref(),
    );
    context.store_answered();
    // Cells that refused a booking during this request.
    let mut refused: Vec<String> = Vec::new();
    // The epoch this request last wrote: while the row still holds it, a failed booking there
    // must lead to the next candidate, not to a pin on the cell that just refused.
    let mut written_by_us: Option<i64> = None;
    for _ in 0..PLACEMENT_ROUNDS {
        let current = context
            .store
            .assignment(user_id, relay_host_id)
            .map_err(&failed)?;
        let allow_pin = !matches!(
            (written_by_us, &current),
            (Some(ours), Some(row)) if row.epoch == ours
        );
        let params = Params {
            now_ms: context.clock.now_ms(),
            heartbeat_fresh_ms: fleet.heartbeat_fresh_ms,
            feed_fresh_ms: fleet.feed_fresh_ms,
            retire_after_ms: fleet.membership.retire_after(context.clock.monotonic_ms()),
        };
        let feeds = fleet.board.snapshot();
        let decision = {
            let mut rng = fleet.rng.lock().unwrap_or_else(|e| e.into_inner());
            placement::decide(
                current.as_ref(),
                &cells,
                &feeds,
                &params,
                &refused,
                allow_pin,
                &mut rng,
            )
        };
        let (epoch, candidate) = match decision {
            Decision::Pin {
                cell_id,
                cell_url,
                epoch,
            } => {
                log::debug!(
                    "orca_relay_host_pinned host={relay_host_id} cell_id={cell_id} epoch={epoch}"
                );
                return Ok(ok_reply(&cell_url, epoch));
            }
            Decision::HomeUnavailable { cell_id } => {
                log::info!(
                    "orca_relay_assign_home_unavailable host={relay_host_id} cell_id={cell_id}"
                );
                return Err(unavailable("relay_home_cell_unavailable"));
            }
            Decision::Exhausted => {
                log::warn!(
                    "orca_relay_assign_capacity_exhausted host={relay_host_id} cells={} refused={}",
                    cells.len(),
                    refused.len()
                );
                return Err(unavailable("relay_capacity_exhausted"));
            }
            Decision::Place {
                epoch,
                mut candidates,
            } => (epoch, candidates.swap_remove(0)),
        };
        let now = context.clock.now_ms() as i64;
        let written = context
            .store
            .place_assignment_if_newer(user_id, relay_host_id, &candidate.cell_id, epoch, now)
            .map_err(&failed)?;
        if !written {
            // Another director placed this host at this epoch or later: decide again.
            continue;
        }
        written_by_us = Some(epoch);
        match book(context, fleet, &candidate, user_id, relay_host_id, epoch) {
            None => {
                log::info!(
                    "orca_relay_host_placed host={relay_host_id} cell_id={} epoch={epoch} path={}",
                    candidate.cell_id,
                    candidate.path.as_str()
                );
                return Ok(ok_reply(&candidate.cell_url, epoch));
            }
            Some(outcome) => {
                log::info!(
                    "orca_relay_assign_booking_refused host={relay_host_id} cell_id={} epoch={epoch} outcome={}",
                    candidate.cell_id,
                    outcome.as_str()
                );
                refused.push(candidate.cell_id);
            }
        }
    }
    Err(Reply::error(503, "relay_placement_contended").with_header("Retry-After", "1"))
}

/// Books the seat when the candidate is on the booking path; `None` when the placement
/// stands, or the refusal.
fn book(
    context: &AssignContext,
    fleet: &Fleet,
    candidate: &Candidate,
    user_id: &str,
    relay_host_id: &str,
    epoch: i64,
) -> Option<ReserveOutcome> {
    if candidate.path != Path::Booking {
        return None;
    }
    let Some(internal_url) = candidate.internal_url.as_deref() else {
        return Some(ReserveOutcome::Failed("no internal url".into()));
    };
    let outcome = fleet.cell_client.reserve(
        internal_url,
        &Booking {
            director_id: &fleet.director_id,
            user_id,
            relay_host_id,
            epoch,
            ttl_ms: BOOKING_TTL_MS,
        },
    );
    context.metrics.reserve(outcome.as_str()).inc();
    if let ReserveOutcome::Failed(reason) = &outcome {
        log::warn!(
            "orca_relay_assign_reserve_failed cell_id={} reason={reason}",
            candidate.cell_id
        );
    }
    (outcome != ReserveOutcome::Ok).then_some(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registered(cell_id: &str) -> CellRow {
        CellRow {
            cell_id: cell_id.into(),
            cell_url: format!("ws://{cell_id}"),
            internal_url: None,
            region: "default".into(),
            incarnation: 1,
            registered_at: 0,
            registered_age_ms: 0,
            runtime: None,
            admit_mode: "db".into(),
            admit_mode_updated_at: None,
            effective: None,
        }
    }

    #[test]
    fn a_draining_in_process_cell_is_left_out_of_placement() {
        let mode = Arc::new(CellMode::new());
        let local = InProcessCell {
            cell_id: "combined".into(),
            mode: mode.clone(),
        };
        let ids = |cells: Vec<CellRow>| -> Vec<String> {
            cells.into_iter().map(|cell| cell.cell_id).collect()
        };
        let cells = || vec![registered("combined"), registered("other")];
        assert_eq!(
            ids(placeable_cells(cells(), Some(&local))),
            ["combined", "other"]
        );
        mode.set_draining();
        assert_eq!(ids(placeable_cells(cells(), Some(&local))), ["other"]);
        assert_eq!(ids(placeable_cells(cells(), None)), ["combined", "other"]);
    }

    #[test]
    fn reserve_answers_parse() {
        let cases = [
            (
                r#"{"v":1,"results":[{"outcome":"ok"}]}"#,
                ReserveOutcome::Ok,
            ),
            (
                r#"{"v":1,"results":[{"outcome":"full"}]}"#,
                ReserveOutcome::Full,
            ),
            (
                r#"{"v":1,"results":[{"outcome":"off"}]}"#,
                ReserveOutcome::Off,
            ),
            (
                r#"{"v":1,"results":[{"outcome":"draining"}]}"#,
                ReserveOutcome::Draining,
            ),
            (
                r#"{"v":1,"results":[{"outcome":"seated-newer","epoch":9}]}"#,
                ReserveOutcome::SeatedNewer { epoch: Some(9) },
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_reserve_answer(text), expected, "{text}");
        }
        for text in [
            "",
            "{}",
            r#"{"results":[]}"#,
            r#"{"results":[{"outcome":"maybe"}]}"#,
        ] {
            assert!(
                matches!(parse_reserve_answer(text), ReserveOutcome::Failed(_)),
                "{text}"
            );
        }
    }
}
