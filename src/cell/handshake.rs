//! The cell's startup registration with its directors, under a fixed budget (SPEC §8).
//!
//! Owns: the handshake [`Budget`] (a pure value whose arithmetic is tested with exact figures)
//! and the synchronous registration loop [`register_with_directors`].
//!
//! Runs on: the thread that starts the cell role, after both listeners are bound and before the
//! cell reports ready. It blocks that thread for at most the aggregate budget (40 s) plus the
//! scheduler's overshoot.
//!
//! Never: retries a definite answer (an HTTP status or a transport failure such as a refused
//! connection: replaying a registration after a definite answer only adds load and hides the
//! cause); runs an attempt on a detached thread (an abandoned attempt could complete after we
//! retried); reports a director as "unreachable" when all we know is that it did not answer in
//! time (the registration may well have completed on the director).
//!
//! One attempt registers every membership in turn, all under one attempt deadline: each HTTP
//! call gets the time left in the attempt as its ureq timeout (connect, write and read). Only
//! that deadline expiring is retried, after a backoff, while the budget allows it.

use std::error::Error as StdError;
use std::fmt;
use std::io::{self, Read};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::config::Config;
use crate::outbound::{is_timeout, is_timeout_io};
use crate::service_token::ServiceTokens;

/// The systemd units' `TimeoutStartSec=45`: systemd kills a `Type=notify` cell that has not
/// sent `READY=1` within 45 s of starting it. The handshake must fail with its own message
/// before that happens.
pub const TIMEOUT_START_SEC_MS: u64 = 45_000;

/// Time kept back from `TimeoutStartSec` for what happens outside the handshake's clock:
/// process start, config parsing, binding the listeners and opening the database before the
/// handshake starts, and surfacing the error after it gives up.
pub const STARTUP_RESERVE_MS: u64 = 5_000;

/// The cap on all attempts plus all backoffs together: 45 s − 5 s = 40 s. It only bites with
/// several memberships or large overrides; the single-membership default (3 × 12 s plus 0.75 s
/// of backoff = 36.75 s) never reaches it.
pub const AGGREGATE_BUDGET_MS: u64 = TIMEOUT_START_SEC_MS - STARTUP_RESERVE_MS;
const _: () = assert!(AGGREGATE_BUDGET_MS + STARTUP_RESERVE_MS <= TIMEOUT_START_SEC_MS);

/// The first wait between attempts: long enough not to hammer a director that just stalled,
/// short enough to cost little of the budget.
pub const BACKOFF_INITIAL_MS: u64 = 250;

/// The backoff doubles after each wait up to this cap, so that many short attempts (an
/// operator's override) still spend most of the budget waiting for answers, not sleeping.
pub const BACKOFF_CAP_MS: u64 = 2_000;

/// The director's registration endpoint (SPEC §6.2).
pub const REGISTER_PATH: &str = "/v1/admin/cells/register";

/// How much of an error response's body goes into the error message.
const ERROR_BODY_CHARS: usize = 200;

/// How much of any response body we read at most.
const RESPONSE_BODY_LIMIT_BYTES: u64 = 64 * 1024;

/// The handshake's time budget. A pure value: every method answers from the elapsed time it is
/// given, so the arithmetic is tested without clocks or servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    per_attempt_ms: u64,
    max_attempts: u32,
    aggregate_ms: u64,
}

impl Budget {
    /// The budget for `memberships` directors registered serially: the per-attempt deadline is
    /// `handshake_timeout_ms × memberships` (saturating), at most `attempts` attempts (at least
    /// one), inside [`AGGREGATE_BUDGET_MS`]. Zero memberships count as one.
    pub fn new(handshake_timeout_ms: u64, attempts: u32, memberships: usize) -> Budget {
        let memberships = u64::try_from(memberships.max(1)).unwrap_or(u64::MAX);
        Budget {
            per_attempt_ms: handshake_timeout_ms.max(1).saturating_mul(memberships),
            max_attempts: attempts.max(1),
            aggregate_ms: AGGREGATE_BUDGET_MS,
        }
    }

    /// The budget for a configured cell: its handshake knobs and its director list.
    pub fn from_config(config: &Config) -> Budget {
        Budget::new(
            config.handshake_timeout_ms,
            config.handshake_attempts,
            config.director_urls.len(),
        )
    }

    /// The same budget with another aggregate cap. Production always uses
    /// [`AGGREGATE_BUDGET_MS`]; tests shrink it together with the timeout so that the cap's
    /// effect shows in a second of wall time.
    pub fn with_aggregate_ms(self, aggregate_ms: u64) -> Budget {
        Budget {
            aggregate_ms: aggregate_ms.max(1),
            ..self
        }
    }

    /// The scaled, uncapped per-attempt deadline (timeout × memberships).
    pub fn per_attempt_ms(&self) -> u64 {
        self.per_attempt_ms
    }

    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    pub fn aggregate_ms(&self) -> u64 {
        self.aggregate_ms
    }

    /// What is left of the aggregate budget after `elapsed_ms`.
    pub fn remaining_ms(&self, elapsed_ms: u64) -> u64 {
        self.aggregate_ms.saturating_sub(elapsed_ms)
    }

    /// The deadline of an attempt starting at `elapsed_ms`: min(per-attempt, remaining), or
    /// `None` when nothing is left (a late wake-up can use the budget up entirely).
    pub fn attempt_deadline_ms(&self, elapsed_ms: u64) -> Option<u64> {
        match self.remaining_ms(elapsed_ms) {
            0 => None,
            remaining => Some(self.per_attempt_ms.min(remaining)),
        }
    }

    /// Whether another attempt may follow after `attempts_made` attempts whose deadlines
    /// expired, at `elapsed_ms`, with `next_backoff_ms` to wait first. Only if attempts remain
    /// and the remaining budget is strictly greater than the backoff, so that the retry gets a
    /// non-zero deadline.
    pub fn retry_fits(&self, attempts_made: u32, elapsed_ms: u64, next_backoff_ms: u64) -> bool {
        attempts_made < self.max_attempts && self.remaining_ms(elapsed_ms) > next_backoff_ms
    }

    /// The wait before retry number `retry` (0 for the wait after the first attempt):
    /// 250, 500, 1000, then 2000 ms each.
    pub fn backoff_ms(retry: u32) -> u64 {
        let mut backoff = BACKOFF_INITIAL_MS;
        // Past a handful of doublings the cap holds; bounding the loop keeps it cheap.
        for _ in 0..retry.min(32) {
            backoff = backoff.saturating_mul(2).min(BACKOFF_CAP_MS);
        }
        backoff.min(BACKOFF_CAP_MS)
    }

    /// The attempt deadlines the loop uses when no director ever answers: every attempt runs
    /// to its deadline, then the loop backs off while the budget allows.
    pub fn plan_never_answering(&self) -> Vec<u64> {
        self.simulate_never_answering().0
    }

    /// The elapsed time at which the loop gives up when no director ever answers: the sum of
    /// [`Budget::plan_never_answering`] and the backoffs between those attempts.
    pub fn never_answering_elapsed_ms(&self) -> u64 {
        self.simulate_never_answering().1
    }

    /// Runs the loop's decisions on a virtual clock, exactly as [`register_with_directors`]
    /// takes them, assuming every attempt runs to its deadline.
    fn simulate_never_answering(&self) -> (Vec<u64>, u64) {
        let mut deadlines = Vec::new();
        let mut elapsed_ms = 0u64;
        let mut retry = 0u32;
        while let Some(deadline_ms) = self.attempt_deadline_ms(elapsed_ms) {
            deadlines.push(deadline_ms);
            elapsed_ms = elapsed_ms.saturating_add(deadline_ms);
            let attempts_made = u32::try_from(deadlines.len()).unwrap_or(u32::MAX);
            let backoff_ms = Budget::backoff_ms(retry);
            if !self.retry_fits(attempts_made, elapsed_ms, backoff_ms) {
                break;
            }
            elapsed_ms = elapsed_ms.saturating_add(backoff_ms);
            retry += 1;
        }
        (deadlines, elapsed_ms)
    }
}

/// The body of `POST /v1/admin/cells/register` (SPEC §8). The director treats a repeat of the
/// same `(cellId, incarnation)` as the same registration, which is what makes an attempt that
/// re-registers every membership safe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegisterRequest {
    pub v: u32,
    pub cell_id: String,
    pub cell_url: String,
    pub region: String,
    pub incarnation: i64,
    /// The cell's HTTP base URL, where directors reach `/internal/*`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub internal_url: Option<String>,
}

impl RegisterRequest {
    /// A version-1 registration.
    pub fn new(
        cell_id: impl Into<String>,
        cell_url: impl Into<String>,
        region: impl Into<String>,
        incarnation: i64,
    ) -> RegisterRequest {
        RegisterRequest {
            v: 1,
            cell_id: cell_id.into(),
            cell_url: cell_url.into(),
            region: region.into(),
            incarnation,
            internal_url: None,
        }
    }

    pub fn with_internal_url(mut self, internal_url: impl Into<String>) -> RegisterRequest {
        self.internal_url = Some(internal_url.into());
        self
    }
}

/// What a successful handshake took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeReport {
    /// Attempts started, counting the successful one; 0 when there were no directors.
    pub attempts: u32,
    pub elapsed_ms: u64,
}

/// Why the handshake failed. Every variant ends the cell's start with a non-zero exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeError {
    /// Every attempt ran to its deadline and the budget allows no more. The outcome on the
    /// directors is unknown.
    Exhausted {
        attempts: u32,
        /// The scaled, uncapped per-attempt deadline; the last attempt may have been shorter.
        per_attempt_ms: u64,
        elapsed_ms: u64,
        aggregate_ms: u64,
        /// The director whose answer was still outstanding when the last deadline expired.
        last_silent_director: String,
    },
    /// A director answered with a non-2xx status.
    HttpStatus {
        director: String,
        status: u16,
        body: String,
    },
    /// The call failed for another reason than our deadline: refused, reset, DNS, TLS, a
    /// malformed answer.
    Transport { director: String, cause: String },
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandshakeError::Exhausted {
                attempts,
                per_attempt_ms,
                elapsed_ms,
                aggregate_ms,
                last_silent_director,
            } => write!(
                f,
                "cell registration received no response before the per-attempt deadline \
                 (last waiting on director {last_silent_director}): {attempts} attempts, \
                 per-attempt deadline up to {per_attempt_ms}ms, elapsed {elapsed_ms}ms of the \
                 {aggregate_ms}ms aggregate limit; the registration is unconfirmed and may \
                 still have completed on the director"
            ),
            HandshakeError::HttpStatus {
                director,
                status,
                body,
            } => write!(
                f,
                "director {director} answered HTTP {status} to cell registration: {body}"
            ),
            HandshakeError::Transport { director, cause } => {
                write!(f, "director {director} failed cell registration: {cause}")
            }
        }
    }
}

impl StdError for HandshakeError {}

/// How one registration call ended, short of success.
enum CallFailure {
    /// Our attempt deadline expired with no answer: retryable.
    DeadlineExpired,
    /// A definite answer or failure: never retried.
    Fatal(HandshakeError),
}

/// Registers this cell with every director in `memberships` (director base URLs), serially,
/// under `budget`. Each attempt posts `request` to every membership in turn with
/// `Authorization: Bearer <service_token>`; only our own attempt deadline expiring is retried,
/// after waiting through `wait` (production passes [`crate::clock::sleep`]). `clock` measures
/// the elapsed time; it must be the system clock in production, since ureq's timeouts run on
/// real time.
pub fn register_with_directors(
    memberships: &[String],
    request: &RegisterRequest,
    service_token: &ServiceTokens,
    budget: &Budget,
    clock: &dyn Clock,
    wait: &dyn Fn(Duration),
) -> Result<HandshakeReport, HandshakeError> {
    register_with_directors_observed(
        memberships,
        request,
        service_token,
        budget,
        clock,
        wait,
        &|_| {},
    )
}

/// [`register_with_directors`], calling `on_attempt(n)` as attempt `n` (1-based) starts, so
/// that the role can show the attempts in `/metrics` while the handshake is still running.
pub fn register_with_directors_observed(
    memberships: &[String],
    request: &RegisterRequest,
    service_token: &ServiceTokens,
    budget: &Budget,
    clock: &dyn Clock,
    wait: &dyn Fn(Duration),
    on_attempt: &dyn Fn(u32),
) -> Result<HandshakeReport, HandshakeError> {
    if memberships.is_empty() {
        return Ok(HandshakeReport {
            attempts: 0,
            elapsed_ms: 0,
        });
    }
    // No redirects: a registration is a POST, and a director that redirects it is
    // misconfigured; the 3xx surfaces as an HTTP status error instead.
    let agent = ureq::AgentBuilder::new()
        .redirects(0)
        .user_agent(concat!("orca-relay/", env!("CARGO_PKG_VERSION")))
        .build();
    let started_ms = clock.now_ms();
    let elapsed = || clock.now_ms().saturating_sub(started_ms);
    let mut attempts = 0u32;
    let mut retry = 0u32;
    let mut last_silent_director = String::new();
    loop {
        let attempt_started_ms = elapsed();
        let Some(attempt_ms) = budget.attempt_deadline_ms(attempt_started_ms) else {
            return Err(exhausted(budget, attempts, elapsed(), last_silent_director));
        };
        attempts += 1;
        on_attempt(attempts);
        let attempt_deadline_ms = started_ms
            .saturating_add(attempt_started_ms)
            .saturating_add(attempt_ms);
        match run_attempt(
            &agent,
            memberships,
            request,
            service_token,
            attempt_deadline_ms,
            clock,
        ) {
            Ok(()) => {
                let report = HandshakeReport {
                    attempts,
                    elapsed_ms: elapsed(),
                };
                log::info!(
                    "orca_relay_handshake_registered attempts={} elapsed_ms={} memberships={}",
                    report.attempts,
                    report.elapsed_ms,
                    memberships.len()
                );
                return Ok(report);
            }
            Err((_, CallFailure::Fatal(error))) => return Err(error),
            Err((director, CallFailure::DeadlineExpired)) => last_silent_director = director,
        }
        let elapsed_ms = elapsed();
        let backoff_ms = Budget::backoff_ms(retry);
        if !budget.retry_fits(attempts, elapsed_ms, backoff_ms) {
            return Err(exhausted(
                budget,
                attempts,
                elapsed_ms,
                last_silent_director,
            ));
        }
        log::warn!(
            "orca_relay_handshake_attempt_timed_out attempt={attempts} max_attempts={} \
             attempt_deadline_ms={attempt_ms} director={last_silent_director} \
             elapsed_ms={elapsed_ms} backoff_ms={backoff_ms}",
            budget.max_attempts()
        );
        wait(Duration::from_millis(backoff_ms));
        retry += 1;
    }
}

fn exhausted(
    budget: &Budget,
    attempts: u32,
    elapsed_ms: u64,
    last_silent_director: String,
) -> HandshakeError {
    HandshakeError::Exhausted {
        attempts,
        per_attempt_ms: budget.per_attempt_ms(),
        elapsed_ms,
        aggregate_ms: budget.aggregate_ms(),
        last_silent_director,
    }
}

/// One attempt: every membership in turn, each call getting the time left until
/// `attempt_deadline_ms`. On failure, returns the director it failed on.
fn run_attempt(
    agent: &ureq::Agent,
    memberships: &[String],
    request: &RegisterRequest,
    service_token: &ServiceTokens,
    attempt_deadline_ms: u64,
    clock: &dyn Clock,
) -> Result<(), (String, CallFailure)> {
    for director in memberships {
        if attempt_deadline_ms <= clock.now_ms() {
            return Err((director.clone(), CallFailure::DeadlineExpired));
        }
        // Each call, a second token's after a 401 included, gets the time left, so the attempt
        // keeps its deadline.
        let time_left =
            || Duration::from_millis(attempt_deadline_ms.saturating_sub(clock.now_ms()).max(1));
        register_once(agent, director, request, service_token, &time_left)
            .map_err(|failure| (director.clone(), failure))?;
    }
    Ok(())
}

/// One `POST <director>/v1/admin/cells/register` under `time_left()` (connect, write and read,
/// body included), with the next service token when the director refuses one (401).
fn register_once(
    agent: &ureq::Agent,
    director: &str,
    request: &RegisterRequest,
    service_token: &ServiceTokens,
    time_left: &dyn Fn() -> Duration,
) -> Result<(), CallFailure> {
    let url = format!("{}{REGISTER_PATH}", director.trim_end_matches('/'));
    let transport_failure = |cause: String| {
        CallFailure::Fatal(HandshakeError::Transport {
            director: director.to_string(),
            cause,
        })
    };
    let answer = service_token
        .call_http(director, time_left(), |token, left| {
            agent
                .post(&url)
                .timeout(left)
                .set("Authorization", &format!("Bearer {token}"))
                .send_json(request)
                .map_err(Box::new)
        })
        .map_err(|error| *error);
    match answer {
        Ok(response) => {
            let status = response.status();
            let body = match read_body(response) {
                Ok(body) => body,
                Err(error) if is_timeout_io(&error) => return Err(CallFailure::DeadlineExpired),
                Err(error) => {
                    return Err(transport_failure(format!(
                        "reading the response body: {error}"
                    )))
                }
            };
            if !(200..300).contains(&status) {
                return Err(CallFailure::Fatal(HandshakeError::HttpStatus {
                    director: director.to_string(),
                    status,
                    body: short_body(&body),
                }));
            }
            // An empty body is fine; anything else must be the director's JSON, or we are
            // talking to something that is not a director.
            if !body.trim().is_empty() {
                if let Err(error) = serde_json::from_str::<serde_json::Value>(&body) {
                    return Err(transport_failure(format!(
                        "HTTP {status} with a body that is not JSON ({error}): {}",
                        short_body(&body)
                    )));
                }
            }
            Ok(())
        }
        Err(ureq::Error::Status(status, response)) => {
            // The status is the definite answer; a body we cannot read only loses detail.
            let body = read_body(response)
                .map(|body| short_body(&body))
                .unwrap_or_else(|error| format!("<body unreadable: {error}>"));
            Err(CallFailure::Fatal(HandshakeError::HttpStatus {
                director: director.to_string(),
                status,
                body,
            }))
        }
        Err(ureq::Error::Transport(transport)) => {
            if is_timeout(&transport) {
                Err(CallFailure::DeadlineExpired)
            } else {
                Err(transport_failure(transport.to_string()))
            }
        }
    }
}

fn read_body(response: ureq::Response) -> io::Result<String> {
    let mut bytes = Vec::new();
    response
        .into_reader()
        .take(RESPONSE_BODY_LIMIT_BYTES)
        .read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The first [`ERROR_BODY_CHARS`] characters of a body, on one line.
fn short_body(body: &str) -> String {
    let one_line: String = body
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(ERROR_BODY_CHARS)
        .collect();
    if body.trim().chars().count() > ERROR_BODY_CHARS {
        format!("{one_line}…")
    } else {
        one_line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The production defaults: 12 s per membership, 3 attempts.
    fn default_budget(memberships: usize) -> Budget {
        Budget::new(12_000, 3, memberships)
    }

    #[test]
    fn the_aggregate_cap_leaves_the_startup_reserve_inside_timeout_start_sec() {
        assert_eq!(AGGREGATE_BUDGET_MS, 40_000);
        // 40 000 ≤ 45 000 − 5 000, for whatever the knobs and the director list say: the
        // loop gives up before systemd's start timeout, with the reserve to spare.
        for (timeout, attempts, memberships) in [(12_000, 3, 1), (12_000, 3, 7), (60_000, 1_000, 1)]
        {
            let budget = Budget::new(timeout, attempts, memberships);
            assert!(
                budget.never_answering_elapsed_ms() <= TIMEOUT_START_SEC_MS - STARTUP_RESERVE_MS,
                "{budget:?}"
            );
        }
    }

    #[test]
    fn one_silent_membership_exhausts_at_36750_ms_after_three_attempts() {
        let budget = default_budget(1);
        assert_eq!(budget.plan_never_answering(), vec![12_000, 12_000, 12_000]);
        // 12 + 0.25 + 12 + 0.5 + 12 s.
        assert_eq!(budget.never_answering_elapsed_ms(), 36_750);
        assert!(budget.never_answering_elapsed_ms() < AGGREGATE_BUDGET_MS);
    }

    #[test]
    fn two_memberships_give_24000_then_15750_and_stop_at_40000() {
        let budget = default_budget(2);
        assert_eq!(budget.per_attempt_ms(), 24_000);
        // 24 s, 0.25 s backoff, then only 15.75 s remain for the second attempt.
        assert_eq!(budget.plan_never_answering(), vec![24_000, 15_750]);
        assert_eq!(budget.never_answering_elapsed_ms(), 40_000);
    }

    #[test]
    fn four_memberships_give_one_attempt_capped_at_40000() {
        let budget = default_budget(4);
        assert_eq!(budget.per_attempt_ms(), 48_000);
        assert_eq!(budget.plan_never_answering(), vec![40_000]);
        assert_eq!(budget.never_answering_elapsed_ms(), 40_000);
    }

    #[test]
    fn one_second_attempts_stop_after_15_at_38750_ms() {
        // Backoffs 0.25 + 0.5 + 1 + 11 × 2 = 23.75 s between 15 attempts of 1 s: 38.75 s.
        // 1.25 s remain, which is not more than the next 2 s backoff, so the loop stops.
        let budget = Budget::new(1_000, 100, 1);
        let plan = budget.plan_never_answering();
        assert_eq!(plan, vec![1_000; 15]);
        assert_eq!(budget.never_answering_elapsed_ms(), 38_750);
        assert!(!budget.retry_fits(15, 38_750, Budget::backoff_ms(14)));
    }

    #[test]
    fn the_other_worked_examples_match_exact_arithmetic() {
        // (timeout, attempts, memberships) → attempt deadlines, exhaustion time.
        let cases: &[(u64, u32, usize, &[u64], u64)] = &[
            (12_000, 3, 3, &[36_000, 3_750], 40_000),
            (60_000, 3, 1, &[40_000], 40_000),
            (20_000, 3, 1, &[20_000, 19_750], 40_000),
            (12_000, 10, 1, &[12_000, 12_000, 12_000, 2_250], 40_000),
            (
                5_000,
                10,
                1,
                &[5_000, 5_000, 5_000, 5_000, 5_000, 5_000, 2_250],
                40_000,
            ),
            // The old default (5 s × 4) exhausted in 21.75 s.
            (5_000, 4, 1, &[5_000, 5_000, 5_000, 5_000], 21_750),
        ];
        for &(timeout, attempts, memberships, deadlines, total) in cases {
            let budget = Budget::new(timeout, attempts, memberships);
            assert_eq!(
                budget.plan_never_answering(),
                deadlines,
                "{timeout}ms × {attempts} attempts × {memberships} memberships"
            );
            assert_eq!(budget.never_answering_elapsed_ms(), total);
        }
    }

    #[test]
    fn a_measured_9500_ms_success_fits_the_first_default_attempt() {
        let budget = default_budget(1);
        let first = budget
            .attempt_deadline_ms(0)
            .expect("a fresh budget allows an attempt");
        assert_eq!(first, 12_000);
        assert!(
            9_500 < first,
            "2.5 s of headroom over the slowest measured success"
        );
    }

    #[test]
    fn backoff_doubles_from_250_ms_and_caps_at_2_s() {
        let sequence: Vec<u64> = (0..7).map(Budget::backoff_ms).collect();
        assert_eq!(sequence, vec![250, 500, 1_000, 2_000, 2_000, 2_000, 2_000]);
        assert_eq!(Budget::backoff_ms(u32::MAX), BACKOFF_CAP_MS);
    }

    #[test]
    fn a_retry_needs_strictly_more_budget_than_its_backoff() {
        let budget = default_budget(1);
        assert!(budget.retry_fits(1, 40_000 - 251, 250));
        assert!(
            !budget.retry_fits(1, 40_000 - 250, 250),
            "equal is not enough"
        );
        assert!(!budget.retry_fits(3, 0, 250), "attempts used up");
    }

    #[test]
    fn the_attempt_deadline_is_the_smaller_of_per_attempt_and_remaining() {
        let budget = default_budget(2);
        assert_eq!(budget.attempt_deadline_ms(0), Some(24_000));
        assert_eq!(budget.attempt_deadline_ms(24_250), Some(15_750));
        assert_eq!(budget.attempt_deadline_ms(39_999), Some(1));
        assert_eq!(budget.attempt_deadline_ms(40_000), None);
        assert_eq!(budget.attempt_deadline_ms(45_000), None);
    }

    #[test]
    fn degenerate_inputs_still_give_a_usable_budget() {
        assert_eq!(Budget::new(12_000, 3, 0), default_budget(1));
        assert_eq!(Budget::new(0, 0, 1).plan_never_answering(), vec![1]);
        assert_eq!(Budget::new(u64::MAX, 3, 5).per_attempt_ms(), u64::MAX);
        let shrunk = Budget::new(400, 3, 2).with_aggregate_ms(1_200);
        assert_eq!(shrunk.plan_never_answering(), vec![800, 150]);
        assert_eq!(shrunk.never_answering_elapsed_ms(), 1_200);
    }

    #[test]
    fn exhaustion_reports_an_unconfirmed_outcome_not_an_unreachable_director() {
        let error = HandshakeError::Exhausted {
            attempts: 3,
            per_attempt_ms: 12_000,
            elapsed_ms: 36_750,
            aggregate_ms: AGGREGATE_BUDGET_MS,
            last_silent_director: "http://director-a:8081".to_string(),
        };
        let message = error.to_string();
        for expected in [
            "no response before the per-attempt deadline",
            "3 attempts",
            "per-attempt deadline up to 12000ms",
            "elapsed 36750ms",
            "40000ms aggregate limit",
            "may still have completed on the director",
            "http://director-a:8081",
        ] {
            assert!(
                message.contains(expected),
                "{expected:?} missing: {message}"
            );
        }
        assert!(!message.to_lowercase().contains("unreachable"), "{message}");
    }

    #[test]
    fn definite_failures_name_the_director_and_the_cause() {
        let status = HandshakeError::HttpStatus {
            director: "http://d:1".to_string(),
            status: 403,
            body: "bad token".to_string(),
        };
        assert_eq!(
            status.to_string(),
            "director http://d:1 answered HTTP 403 to cell registration: bad token"
        );
        let transport = HandshakeError::Transport {
            director: "http://d:1".to_string(),
            cause: "connection refused".to_string(),
        };
        assert_eq!(
            transport.to_string(),
            "director http://d:1 failed cell registration: connection refused"
        );
    }

    #[test]
    fn error_bodies_are_shortened_to_one_line() {
        assert_eq!(short_body("  line one\nline two \n"), "line one line two");
        let long = "x".repeat(500);
        let short = short_body(&long);
        assert_eq!(short.chars().count(), ERROR_BODY_CHARS + 1);
        assert!(short.ends_with('…'));
    }

    #[test]
    fn the_register_request_is_camel_case_version_1() {
        let request = RegisterRequest::new("cell-a", "wss://a.example", "eu", 1_700_000_000_000);
        let json = serde_json::to_value(&request).expect("serialises");
        assert_eq!(
            json,
            serde_json::json!({
                "v": 1,
                "cellId": "cell-a",
                "cellUrl": "wss://a.example",
                "region": "eu",
                "incarnation": 1_700_000_000_000i64,
            })
        );
    }

    #[test]
    fn no_directors_means_nothing_to_register() {
        let clock = crate::clock::ManualClock::starting_at(0);
        let report = register_with_directors(
            &[],
            &RegisterRequest::new("c", "ws://c", "r", 1),
            &ServiceTokens::single("token"),
            &default_budget(0),
            clock.as_ref(),
            &|_| panic!("no wait without attempts"),
        )
        .expect("nothing to do");
        assert_eq!(
            report,
            HandshakeReport {
                attempts: 0,
                elapsed_ms: 0
            }
        );
    }
}
