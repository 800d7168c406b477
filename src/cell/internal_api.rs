//! The director-facing internal API (SPEC §5.4): `POST /internal/reserve` and
//! `GET /internal/seats`, on the HTTP listener, behind `Authorization: Bearer $SERVICE_TOKEN`.
//!
//! Owns: nothing but handles. The bookings live in [`Bookings`], the seats in [`SeatLog`], the
//! dead-man contact in [`Contact`]; the cell's mode and counts come from a status function the
//! role wiring provides, read once per request.
//! Runs on: the `http-<n>` connection threads; each request is a plain function call that takes
//! a few short locks and returns.
//! Must never: look at a body or a query before the service token matched (constant-time), read
//! more than 16 KiB of a body, book anything from a request that is invalid as a whole, or
//! block on a dependency.
//!
//! The seat feed's answer carries, besides SPEC §5.4's fields, a `status` object
//! ([`crate::cell::status_report::StatusReport`]: dead-man state and window left, trip-slot
//! claim and trip slots in force, connections and cap, pool in use and ceiling, ready), built
//! from in-memory state only, for `GET /v1/admin/cells` and `orca-relay fleet status`. It is an
//! additive field: directors that do not know it ignore it.
//!
//! Dead-man contact (SPEC §5.5) is recorded here: a reserve request with at least one `ok`
//! outcome (a real booking), and a seat-feed poll carrying `reserver=1`. A poll without it (a
//! dashboard, a director that only watches) is not contact. The time between two `reserver=1`
//! polls goes into `orca_relay_dead_man_contact_interval_ms`: what the director's feed poller
//! promises (every live cell within 2 × `FEED_POLL_MS`) is checked there, on the cell.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::cell::bookings::{Bookings, Outcome, ReserveContext, ReserveItem, MAX_BOOKING_TTL_MS};
use crate::cell::contact::Contact;
use crate::cell::seats::{parse_cursor, ChangeKind, FeedBody, FeedHeader, SeatChange, SeatLog};
use crate::cell::status_report::ReportFn;
use crate::cell::switch::AdmitMode;
use crate::clock::SharedClock;
use crate::config::is_id;
use crate::http::{self, BodyError, Reply};
use crate::metrics::{Counter, Histogram, Registry};
use crate::service_token::ServiceTokens;

/// Largest reserve body (SPEC §5.4).
pub const MAX_BODY_BYTES: usize = 16 * 1024;
/// Most items in one reserve request (SPEC §5.4).
pub const MAX_ITEMS: usize = 64;
/// A relay host id is exactly this many characters of `[A-Za-z0-9_-]` (SPEC §5.2).
pub const RELAY_HOST_ID_LEN: usize = 16;
/// User ids (the token's `sub`) are at most this long.
pub const MAX_USER_ID_LEN: usize = 128;
/// Director ids only name the caller in logs; they are bounded so a log line stays a line.
pub const MAX_DIRECTOR_ID_LEN: usize = 128;

pub const RESERVE_PATH: &str = "/internal/reserve";
pub const SEATS_PATH: &str = "/internal/seats";

/// The cell's state as the internal API needs it, sampled once per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellStatus {
    /// SPEC §5.3 raw mode: `db` unless the switch says `reserve` and the dead-man has not
    /// tripped for that generation.
    pub admit_mode_raw: AdmitMode,
    /// The mode this cell last published in its admit-effective row (SPEC §5.5).
    pub admit_mode_effective: AdmitMode,
    /// Bookings are honoured now (admission runs in reserve mode, a held cell included);
    /// otherwise every item is answered `off`.
    pub reserve_mode_effective: bool,
    pub draining: bool,
    /// WebSocket connections held now.
    pub connections: u64,
}

/// Reads the cell's status; provided by the role wiring.
pub type StatusFn = Arc<dyn Fn() -> CellStatus + Send + Sync>;

/// Everything the internal API is built from.
pub struct InternalApiParts {
    /// `ORCA_RELAY_SERVICE_TOKEN`: any token of the list is accepted.
    pub service_tokens: ServiceTokens,
    pub cell_id: String,
    pub bookings: Arc<Bookings>,
    pub seats: Arc<SeatLog>,
    pub contact: Contact,
    pub status: StatusFn,
    /// The `status` object of the feed's answer (in-memory state only, no SQL).
    pub report: ReportFn,
    pub clock: SharedClock,
}

struct ApiMetrics {
    unauthorized: Counter,
    ok: Counter,
    full: Counter,
    draining: Counter,
    off: Counter,
    seated_newer: Counter,
    feed_full: Counter,
    feed_changes: Counter,
    contact_interval: Histogram,
}

/// The bounds of `orca_relay_dead_man_contact_interval_ms`: each of them is twice a plausible
/// `FEED_POLL_MS`, so "every contact within 2 × FEED_POLL_MS" reads off one bucket.
pub const CONTACT_INTERVAL_BOUNDS_MS: [u64; 12] = [
    100, 200, 400, 500, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000,
];

impl ApiMetrics {
    fn new(registry: &Registry) -> Self {
        let outcome = |name| {
            registry.counter(
                "orca_relay_cell_reserve_items_total",
                "Reserve items answered, by outcome.",
                &[("outcome", name)],
            )
        };
        let feed = |body| {
            registry.counter(
                "orca_relay_cell_seat_feed_total",
                "Seat feed answers, by body (full snapshot or changes).",
                &[("body", body)],
            )
        };
        ApiMetrics {
            unauthorized: registry.counter(
                "orca_relay_cell_internal_unauthorized_total",
                "Internal API requests refused for a missing or wrong service token.",
                &[],
            ),
            ok: outcome("ok"),
            full: outcome("full"),
            draining: outcome("draining"),
            off: outcome("off"),
            seated_newer: outcome("seated-newer"),
            feed_full: feed("full"),
            feed_changes: feed("changes"),
            contact_interval: registry.histogram(
                "orca_relay_dead_man_contact_interval_ms",
                "Time between two reserver=1 seat-feed polls (the directors' dead-man contact).",
                &[],
                &CONTACT_INTERVAL_BOUNDS_MS,
            ),
        }
    }

    fn outcome(&self, outcome: Outcome) -> &Counter {
        match outcome {
            Outcome::Ok { .. } => &self.ok,
            Outcome::Full => &self.full,
            Outcome::Draining => &self.draining,
            Outcome::Off => &self.off,
            Outcome::SeatedNewer { .. } => &self.seated_newer,
        }
    }
}

/// The handlers of the internal API.
pub struct InternalApi {
    parts: InternalApiParts,
    metrics: ApiMetrics,
    /// When the last `reserver=1` poll arrived, plus one (0 = none yet).
    last_reserver_poll_plus_one: AtomicU64,
    /// Refused requests are counted each (`orca_relay_cell_internal_unauthorized_total`) and
    /// logged through one throttle: the first, then at most one line a minute with a count.
    refusals: crate::logging::SharedThrottle,
}

/// A 400 with the reason in the body (every 400 here has this shape).
fn bad_request(reason: impl Into<String>) -> Reply {
    Reply::json(
        400,
        json!({"error": "bad_request", "reason": reason.into()}).to_string(),
    )
}

impl InternalApi {
    pub fn new(parts: InternalApiParts, registry: &Registry) -> Self {
        InternalApi {
            parts,
            metrics: ApiMetrics::new(registry),
            last_reserver_poll_plus_one: AtomicU64::new(0),
            refusals: crate::logging::SharedThrottle::new(),
        }
    }

    /// Answers the internal API's paths; `None` for any other path (the caller routes on).
    pub fn handle(&self, request: &mut http::Request<'_>) -> Option<Reply> {
        let path = request.path;
        if path != RESERVE_PATH && path != SEATS_PATH {
            return None;
        }
        if !self.parts.service_tokens.accepts(request.authorization) {
            self.metrics.unauthorized.inc();
            if let Some(note) = self.refusals.failure(self.parts.clock.now_ms()) {
                log::warn!(
                    "orca_relay_cell_internal_unauthorized path={path} token={}{note}",
                    if request.authorization.is_some() {
                        "wrong"
                    } else {
                        "missing"
                    }
                );
            }
            return Some(Reply::error(401, "unauthorized"));
        }
        Some(match (path, request.method) {
            (RESERVE_PATH, "POST") => self.reserve(request),
            (SEATS_PATH, "GET") => self.seats(request),
            (RESERVE_PATH, _) => {
                Reply::error(405, "method_not_allowed").with_header("Allow", "POST")
            }
            _ => Reply::error(405, "method_not_allowed").with_header("Allow", "GET"),
        })
    }

    fn reserve(&self, request: &mut http::Request<'_>) -> Reply {
        let body = match request.body(MAX_BODY_BYTES) {
            Ok(body) => body,
            Err(BodyError::TooLarge) => return Reply::error(413, "body_too_large"),
            Err(BodyError::Unreadable) => return bad_request("the body could not be read"),
        };
        let parsed = match parse_reserve(&body) {
            Ok(parsed) => parsed,
            Err(reason) => return bad_request(reason),
        };

        let now_ms = self.parts.clock.now_ms();
        let status = (self.parts.status)();
        let mut results = Vec::with_capacity(parsed.items.len());
        let mut booked = 0usize;
        for item in parsed.items {
            let context = ReserveContext {
                reserve_mode_effective: status.reserve_mode_effective,
                draining: status.draining,
                seated_epoch: self
                    .parts
                    .seats
                    .seated_epoch(&item.user_id, &item.relay_host_id),
            };
            let change = SeatChange {
                kind: ChangeKind::Reserve,
                user_id: item.user_id.clone(),
                relay_host_id: item.relay_host_id.clone(),
                epoch: item.epoch,
                generation: 0,
                at_ms: now_ms,
            };
            let outcome = self.parts.bookings.reserve(item, context, now_ms);
            self.metrics.outcome(outcome).inc();
            match outcome {
                Outcome::Ok { refreshed } => {
                    booked += 1;
                    if !refreshed {
                        self.parts.seats.record(change);
                    }
                    results.push(json!({"outcome": outcome.as_str()}));
                }
                Outcome::SeatedNewer { epoch } => {
                    results.push(json!({"outcome": outcome.as_str(), "epoch": epoch}))
                }
                _ => results.push(json!({"outcome": outcome.as_str()})),
            }
        }
        if booked > 0 {
            self.parts.contact.record(now_ms);
        }
        log::debug!(
            "orca_relay_cell_reserve director_id={} items={} ok={booked}",
            parsed.director_id,
            results.len()
        );
        Reply::json(200, json!({"v": 1, "results": results}).to_string())
    }

    fn seats(&self, request: &mut http::Request<'_>) -> Reply {
        // An empty `since=` is the same as none: a first poll.
        let since = match request
            .query_param("since")
            .filter(|value| !value.is_empty())
        {
            None => None,
            Some(text) => match parse_cursor(text) {
                Ok(cursor) => Some(cursor),
                Err(reason) => return bad_request(reason),
            },
        };
        let reserver = match request.query_param("reserver") {
            None | Some("") | Some("0") => false,
            Some("1") => true,
            Some(_) => return bad_request("reserver must be 0 or 1"),
        };
        let now_ms = self.parts.clock.now_ms();
        if reserver {
            self.parts.contact.record(now_ms);
            let previous = self
                .last_reserver_poll_plus_one
                .fetch_max(now_ms.saturating_add(1), Ordering::AcqRel);
            if let Some(previous) = previous.checked_sub(1).filter(|p| *p <= now_ms) {
                self.metrics.contact_interval.observe(now_ms - previous);
            }
        }
        // Sweep expired bookings so the count the director sees is the units really held.
        self.parts.bookings.expire(now_ms);
        let status = (self.parts.status)();
        let feed = self.parts.seats.feed(since);
        match feed.body {
            FeedBody::Full(_) => self.metrics.feed_full.inc(),
            FeedBody::Changes(_) => self.metrics.feed_changes.inc(),
        }
        let header = FeedHeader {
            cell_id: &self.parts.cell_id,
            admit_mode_raw: status.admit_mode_raw.as_str(),
            admit_mode_effective: status.admit_mode_effective.as_str(),
            draining: status.draining,
            bookings: self.parts.bookings.len(),
            connections: status.connections,
        };
        let mut answer = feed.to_json(&header);
        if let Value::Object(fields) = &mut answer {
            let report = (self.parts.report)();
            fields.insert(
                "status".into(),
                serde_json::to_value(report).unwrap_or(Value::Null),
            );
        }
        Reply::json(200, answer.to_string())
    }
}

/// A reserve request, validated as a whole.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReserveRequest {
    director_id: String,
    items: Vec<ReserveItem>,
}

/// Validates a reserve body. The error is the 400's reason; an item's reason names its index.
fn parse_reserve(body: &[u8]) -> Result<ReserveRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let object = value.as_object().ok_or("the body must be a JSON object")?;
    if object.get("v").and_then(Value::as_u64) != Some(1) {
        return Err("v must be 1".into());
    }
    let director_id = object
        .get("directorId")
        .and_then(Value::as_str)
        .filter(|id| is_id(id, MAX_DIRECTOR_ID_LEN))
        .ok_or("directorId must be 1-128 characters [A-Za-z0-9_-]")?;
    let items = object
        .get("items")
        .and_then(Value::as_array)
        .ok_or("items must be an array")?;
    if items.is_empty() {
        return Err("items must not be empty".into());
    }
    if items.len() > MAX_ITEMS {
        return Err("too_many_items".into());
    }
    let items = items
        .iter()
        .enumerate()
        .map(|(index, item)| parse_item(index, item))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ReserveRequest {
        director_id: director_id.to_string(),
        items,
    })
}

fn parse_item(index: usize, item: &Value) -> Result<ReserveItem, String> {
    let field = |name: &str| item.get(name);
    let user_id = field("userId")
        .and_then(Value::as_str)
        .filter(|id| is_id(id, MAX_USER_ID_LEN))
        .ok_or_else(|| format!("items[{index}].userId must be 1-128 characters [A-Za-z0-9_-]"))?;
    let relay_host_id = field("relayHostId")
        .and_then(Value::as_str)
        .filter(|id| id.len() == RELAY_HOST_ID_LEN && is_id(id, RELAY_HOST_ID_LEN))
        .ok_or_else(|| format!("items[{index}].relayHostId must be 16 characters [A-Za-z0-9_-]"))?;
    let epoch = field("epoch")
        .and_then(Value::as_i64)
        .filter(|epoch| *epoch >= 0)
        .ok_or_else(|| format!("items[{index}].epoch must be a non-negative integer"))?;
    let ttl_ms = field("ttlMs")
        .and_then(Value::as_u64)
        .filter(|ttl| (1..=MAX_BOOKING_TTL_MS).contains(ttl))
        .ok_or_else(|| {
            format!("items[{index}].ttlMs must be an integer from 1 to {MAX_BOOKING_TTL_MS}")
        })?;
    Ok(ReserveItem {
        user_id: user_id.to_string(),
        relay_host_id: relay_host_id.to_string(),
        epoch,
        ttl_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell::state::ConnectionSlots;
    use crate::cell::status_report::{DeadManReport, StatusReport};
    use crate::clock::{Clock, ManualClock};
    use crate::http::HttpServer;
    use std::net::TcpListener;
    use std::sync::Mutex;
    use std::time::Duration;

    const TOKEN: &str = "service-token-for-tests";
    const HOST: &str = "abcdefghijklmnop";
    const INCARNATION: i64 = 77;

    /// A real HTTP listener on 127.0.0.1:0 serving the internal API, with the clock, the
    /// status and the shared state in the test's hands.
    struct Harness {
        base: String,
        agent: ureq::Agent,
        server: Option<HttpServer>,
        clock: Arc<ManualClock>,
        status: Arc<Mutex<CellStatus>>,
        slots: Arc<ConnectionSlots>,
        bookings: Arc<Bookings>,
        seats: Arc<SeatLog>,
        contact: Contact,
        registry: Registry,
    }

    impl Harness {
        fn start(cap: u32, ring: usize) -> Harness {
            let clock = ManualClock::starting_at(1_000_000);
            let status = Arc::new(Mutex::new(CellStatus {
                admit_mode_raw: AdmitMode::Reserve,
                admit_mode_effective: AdmitMode::Reserve,
                reserve_mode_effective: true,
                draining: false,
                connections: 0,
            }));
            let slots = ConnectionSlots::new(cap);
            let bookings = Arc::new(Bookings::new(slots.clone()));
            let seats = Arc::new(SeatLog::new(INCARNATION, ring));
            let contact = Contact::new();
            let registry = Registry::new();
            let status_fn: StatusFn = {
                let status = status.clone();
                Arc::new(move || *status.lock().unwrap())
            };
            let api = Arc::new(InternalApi::new(
                InternalApiParts {
                    service_tokens: ServiceTokens::single(TOKEN),
                    cell_id: "c7".into(),
                    bookings: bookings.clone(),
                    seats: seats.clone(),
                    contact: contact.clone(),
                    status: status_fn,
                    report: Arc::new(|| StatusReport {
                        dead_man: DeadManReport::Armed,
                        window_ms: 61_000,
                        window_left_ms: Some(61_000),
                        trip_slots: Some(2),
                        ..StatusReport::default()
                    }),
                    clock: clock.clone(),
                },
                &registry,
            ));
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let base = format!("http://{}", listener.local_addr().unwrap());
            let server = HttpServer::start(
                listener,
                crate::http::HttpSettings::default(),
                Arc::new(move |request| {
                    api.handle(request)
                        .unwrap_or_else(|| Reply::error(404, "not_found"))
                }),
                &registry,
                &crate::liveness::Liveness::detached(clock.clone()),
            )
            .unwrap();
            let agent = ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(10))
                .build();
            Harness {
                base,
                agent,
                server: Some(server),
                clock,
                status,
                slots,
                bookings,
                seats,
                contact,
                registry,
            }
        }

        fn answer(result: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
            let response = match result {
                Ok(response) => response,
                Err(ureq::Error::Status(_, response)) => response,
                Err(other) => panic!("transport error: {other}"),
            };
            let status = response.status();
            let body = response.into_string().unwrap();
            (status, serde_json::from_str(&body).unwrap_or(Value::Null))
        }

        fn post_raw(&self, token: Option<&str>, body: &str) -> (u16, Value) {
            let mut request = self.agent.post(&format!("{}{RESERVE_PATH}", self.base));
            if let Some(token) = token {
                request = request.set("Authorization", &format!("Bearer {token}"));
            }
            Self::answer(
                request
                    .set("Content-Type", "application/json")
                    .send_string(body),
            )
        }

        fn reserve(&self, items: Value) -> (u16, Value) {
            let body = json!({"v": 1, "directorId": "d1", "items": items});
            self.post_raw(Some(TOKEN), &body.to_string())
        }

        fn get(&self, token: Option<&str>, query: &str) -> (u16, Value) {
            let mut request = self.agent.get(&format!("{}{SEATS_PATH}{query}", self.base));
            if let Some(token) = token {
                request = request.set("Authorization", &format!("Bearer {token}"));
            }
            Self::answer(request.call())
        }

        fn seats(&self, query: &str) -> (u16, Value) {
            self.get(Some(TOKEN), query)
        }

        fn join(&self, user: &str, host: &str, epoch: i64, generation: u64) {
            self.seats.record(SeatChange {
                kind: ChangeKind::Join,
                user_id: user.into(),
                relay_host_id: host.into(),
                epoch,
                generation,
                at_ms: self.clock.now_ms(),
            });
        }
    }

    impl Drop for Harness {
        fn drop(&mut self) {
            if let Some(server) = self.server.take() {
                server.stop();
            }
        }
    }

    fn item(user: &str, host: &str, epoch: i64, ttl_ms: u64) -> Value {
        json!({"userId": user, "relayHostId": host, "epoch": epoch, "ttlMs": ttl_ms})
    }

    fn host(n: usize) -> String {
        format!("host{n:012}")
    }

    fn outcomes(answer: &Value) -> Vec<String> {
        answer["results"]
            .as_array()
            .expect("results")
            .iter()
            .map(|r| r["outcome"].as_str().unwrap().to_string())
            .collect()
    }

    fn assert_bad_request(answer: (u16, Value), reason_contains: &str) {
        assert_eq!(answer.0, 400, "{:?}", answer.1);
        assert_eq!(answer.1["error"], "bad_request");
        let reason = answer.1["reason"].as_str().expect("a reason");
        assert!(
            reason.contains(reason_contains),
            "reason {reason:?} does not mention {reason_contains:?}"
        );
    }

    #[test]
    fn a_missing_or_wrong_token_is_401_and_books_nothing() {
        let h = Harness::start(10, 16);
        let body = json!({"v":1,"directorId":"d1","items":[item("u", HOST, 1, 1000)]}).to_string();
        for token in [None, Some("wrong"), Some("service-token-for-test")] {
            let (status, answer) = h.post_raw(token, &body);
            assert_eq!(status, 401, "token {token:?}");
            assert_eq!(answer["error"], "unauthorized");
            assert_eq!(h.get(token, "?reserver=1").0, 401);
        }
        assert_eq!(h.slots.used(), 0);
        assert_eq!(h.contact.last(), None, "refused calls are not contact");
        // The token is checked before the body: even an oversized body gets 401 first.
        let big = "x".repeat(MAX_BODY_BYTES + 1);
        assert_eq!(h.post_raw(None, &big).0, 401);
        assert!(h
            .registry
            .render()
            .contains("orca_relay_cell_internal_unauthorized_total 7"));
    }

    #[test]
    fn a_body_over_16_kib_is_413() {
        let h = Harness::start(10, 16);
        let (status, answer) = h.post_raw(Some(TOKEN), &" ".repeat(MAX_BODY_BYTES + 1));
        assert_eq!(status, 413);
        assert_eq!(answer["error"], "body_too_large");
        // Exactly 16 KiB is read (and here refused as an empty JSON document, not as too big).
        let (status, _) = h.post_raw(Some(TOKEN), &" ".repeat(MAX_BODY_BYTES));
        assert_eq!(status, 400);
    }

    #[test]
    fn sixty_four_items_book_and_sixty_five_are_refused_whole() {
        let h = Harness::start(1_000, 16);
        let too_many: Vec<Value> = (0..65).map(|n| item("u", &host(n), 1, 5_000)).collect();
        assert_bad_request(h.reserve(Value::Array(too_many)), "too_many_items");
        assert_eq!(h.slots.used(), 0, "an invalid request books nothing");
        let most: Vec<Value> = (0..64).map(|n| item("u", &host(n), 1, 5_000)).collect();
        let (status, answer) = h.reserve(Value::Array(most));
        assert_eq!(status, 200);
        assert_eq!(answer["v"], 1);
        assert_eq!(outcomes(&answer), vec!["ok"; 64]);
        assert_eq!(h.slots.used(), 64);
        assert_bad_request(h.reserve(json!([])), "items must not be empty");
    }

    #[test]
    fn invalid_items_are_400_with_a_reason_naming_the_item() {
        let h = Harness::start(10, 16);
        assert_bad_request(
            h.reserve(json!([item("u", HOST, 1, 1000), item("u", HOST, -1, 1000)])),
            "items[1].epoch",
        );
        assert_bad_request(
            h.reserve(json!([item("u", HOST, 1, MAX_BOOKING_TTL_MS + 1)])),
            "items[0].ttlMs",
        );
        assert_bad_request(h.reserve(json!([item("u", HOST, 1, 0)])), "items[0].ttlMs");
        assert_bad_request(
            h.reserve(json!([item("u", "short", 1, 1000)])),
            "items[0].relayHostId",
        );
        assert_bad_request(
            h.reserve(json!([item("u", "abcdefghijklmno!", 1, 1000)])),
            "items[0].relayHostId",
        );
        assert_bad_request(
            h.reserve(json!([item("a b", HOST, 1, 1000)])),
            "items[0].userId",
        );
        assert_bad_request(
            h.reserve(json!([{"userId": "u", "relayHostId": HOST, "epoch": 1.5, "ttlMs": 10}])),
            "items[0].epoch",
        );
        assert_bad_request(
            h.post_raw(
                Some(TOKEN),
                &json!({"v":2,"directorId":"d1","items":[item("u", HOST, 1, 1000)]}).to_string(),
            ),
            "v must be 1",
        );
        assert_bad_request(h.post_raw(Some(TOKEN), "{not json"), "not JSON");
        assert_eq!(h.slots.used(), 0);
        assert_eq!(h.contact.last(), None);
        // The longest TTL is accepted.
        let (status, answer) = h.reserve(json!([item("u", HOST, 1, MAX_BOOKING_TTL_MS)]));
        assert_eq!((status, outcomes(&answer)), (200, vec!["ok".to_string()]));
    }

    #[test]
    fn outcomes_come_back_in_item_order() {
        let h = Harness::start(2, 16);
        h.join("u", &host(1), 7, 1);
        let (status, answer) = h.reserve(json!([
            item("u", &host(0), 1, 5_000),
            item("u", &host(1), 3, 5_000),
            item("u", &host(2), 1, 5_000),
            item("u", &host(3), 1, 5_000),
            item("u", &host(0), 1, 5_000),
        ]));
        assert_eq!(status, 200);
        assert_eq!(
            outcomes(&answer),
            vec!["ok", "seated-newer", "ok", "full", "ok"]
        );
        assert_eq!(answer["results"][1]["epoch"], 7);
        assert!(answer["results"][0].get("epoch").is_none());
        assert_eq!(
            h.slots.used(),
            2,
            "the repeated booking took no second unit"
        );

        h.status.lock().unwrap().reserve_mode_effective = false;
        let (_, answer) = h.reserve(json!([item("u", &host(4), 1, 5_000)]));
        assert_eq!(outcomes(&answer), vec!["off"]);
        h.status.lock().unwrap().draining = true;
        let (_, answer) = h.reserve(json!([item("u", &host(4), 1, 5_000)]));
        assert_eq!(outcomes(&answer), vec!["draining"]);
        assert!(h
            .registry
            .render()
            .contains("orca_relay_cell_reserve_items_total{outcome=\"seated-newer\"} 1"));
    }

    #[test]
    fn only_a_real_booking_or_a_reserver_poll_is_contact() {
        let h = Harness::start(10, 16);
        h.status.lock().unwrap().reserve_mode_effective = false;
        h.reserve(json!([item("u", HOST, 1, 5_000)]));
        assert_eq!(h.contact.last(), None, "an `off` answer is not a booking");

        h.status.lock().unwrap().reserve_mode_effective = true;
        h.clock.set(2_000_000);
        h.reserve(json!([item("u", HOST, 1, 5_000)]));
        assert_eq!(h.contact.last(), Some(2_000_000), "a booking is contact");

        h.clock.set(3_000_000);
        for query in ["", "?reserver=0", "?since=77:0"] {
            assert_eq!(h.seats(query).0, 200);
        }
        assert_eq!(
            h.contact.last(),
            Some(2_000_000),
            "plain polls are not contact"
        );
        assert_eq!(h.seats("?since=77:0&reserver=1").0, 200);
        assert_eq!(
            h.contact.last(),
            Some(3_000_000),
            "a reserver poll is contact"
        );
        assert_bad_request(h.seats("?reserver=yes"), "reserver");
    }

    #[test]
    fn the_time_between_reserver_polls_is_the_contact_interval() {
        let h = Harness::start(10, 16);
        let interval = h.registry.histogram(
            "orca_relay_dead_man_contact_interval_ms",
            "",
            &[],
            &CONTACT_INTERVAL_BOUNDS_MS,
        );
        h.clock.set(5_000_000);
        assert_eq!(h.seats("?reserver=1").0, 200);
        assert_eq!(interval.count(), 0, "the first poll has nothing before it");
        h.clock.set(5_000_900);
        assert_eq!(h.seats("?reserver=1").0, 200);
        // A booking and a plain poll are not feed-poll contact intervals.
        h.clock.set(5_002_000);
        h.reserve(json!([item("u", HOST, 1, 5_000)]));
        assert_eq!(h.seats("").0, 200);
        h.clock.set(5_004_100);
        assert_eq!(h.seats("?reserver=1").0, 200);
        assert_eq!(interval.count(), 2);
        assert_eq!(interval.count_above(1_000), 1, "900 ms, then 3200 ms");
        assert_eq!(interval.count_above(4_000), 0);
        let (_, text) = (0, h.registry.render());
        assert!(
            text.contains("orca_relay_dead_man_contact_interval_ms_bucket{le=\"2000\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn every_feed_answer_carries_the_cells_status_report() {
        let h = Harness::start(10, 16);
        for query in ["?reserver=1", "", "?since=77:0"] {
            let (code, answer) = h.seats(query);
            assert_eq!(code, 200, "{query}");
            assert_eq!(answer["status"]["deadMan"], "armed", "{query}: {answer}");
            assert_eq!(answer["status"]["windowLeftMs"], 61_000);
            assert_eq!(answer["status"]["tripSlots"], 2);
            assert_eq!(answer["admitModeRaw"], "reserve", "SPEC §5.4's fields stay");
        }
    }

    #[test]
    fn a_malformed_cursor_is_400_with_a_reason() {
        let h = Harness::start(10, 16);
        assert_bad_request(h.seats("?since=garbage"), "cursor");
        assert_bad_request(h.seats("?since=77:x"), "cursor seq");
        assert_bad_request(h.seats("?since=77:-1&reserver=1"), "cursor seq");
        assert_eq!(h.contact.last(), None, "a refused poll is not contact");
    }

    #[test]
    fn the_feed_gives_a_snapshot_then_changes_then_a_snapshot_when_the_cursor_is_too_old() {
        let h = Harness::start(10, 3);
        h.status.lock().unwrap().connections = 5;
        h.join("u", &host(1), 4, 1);
        let (status, first) = h.seats("?reserver=1");
        assert_eq!(status, 200);
        assert_eq!(first["v"], 1);
        assert_eq!(first["cellId"], "c7");
        assert_eq!(first["incarnation"], INCARNATION);
        assert_eq!(first["seq"], 1);
        assert_eq!(first["admitModeRaw"], "reserve");
        assert_eq!(first["admitModeEffective"], "reserve");
        assert_eq!(first["draining"], false);
        assert_eq!(
            first["counts"],
            json!({"seated": 1, "bookings": 0, "connections": 5})
        );
        assert_eq!(
            first["full"],
            json!([{"userId":"u","relayHostId":host(1),"epoch":4,"generation":1,"since":1_000_000}])
        );
        assert!(first.get("changes").is_none());

        // A booking shows up as a `reserve` change after the cursor.
        h.clock.advance(10);
        h.reserve(json!([item("u", HOST, 2, 5_000)]));
        let (_, next) = h.seats(&format!("?since={INCARNATION}:1"));
        assert_eq!(next["seq"], 2);
        assert_eq!(
            next["changes"],
            json!([{"kind":"reserve","userId":"u","relayHostId":HOST,"epoch":2,"generation":0,"at":1_000_010}])
        );
        assert_eq!(next["counts"]["bookings"], 1);
        assert!(next.get("full").is_none());

        // Three more changes push seq 2 out of a ring of three: cursor 1 is too old now.
        for n in 2..5 {
            h.join("u", &host(n), 1, 1);
        }
        let (_, stale) = h.seats(&format!("?since={INCARNATION}:1"));
        assert_eq!(stale["seq"], 5);
        assert_eq!(stale["full"].as_array().unwrap().len(), 4);
        let (_, other_incarnation) = h.seats("?since=76:5");
        assert!(other_incarnation.get("full").is_some());
        let (_, current) = h.seats(&format!("?since={INCARNATION}:2"));
        assert_eq!(current["changes"].as_array().unwrap().len(), 3);

        // Expired bookings are swept before they are counted.
        h.clock.advance(5_000);
        let (_, later) = h.seats("");
        assert_eq!(later["counts"]["bookings"], 0);
        assert_eq!(h.slots.used(), 0);
        assert_eq!(h.bookings.len(), 0);
    }

    #[test]
    fn other_paths_are_not_ours_and_wrong_methods_are_405() {
        let h = Harness::start(10, 16);
        let (status, _) =
            Harness::answer(h.agent.get(&format!("{}/internal/other", h.base)).call());
        assert_eq!(status, 404, "handle returned None");
        let (status, _) = Harness::answer(
            h.agent
                .get(&format!("{}{RESERVE_PATH}", h.base))
                .set("Authorization", &format!("Bearer {TOKEN}"))
                .call(),
        );
        assert_eq!(status, 405);
    }
}
