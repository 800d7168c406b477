//! The fleet's service tokens (`ORCA_RELAY_SERVICE_TOKEN`): the shared bearer secret of every
//! director↔cell call (registration, heartbeats, bookings, seat-feed polls, the admin API).
//!
//! The variable is a comma list. The **first** token is the one this process sends; **any** of
//! them is accepted. A peer that answers 401 to the first is asked again with the next one, and
//! the token it took is remembered for that peer ([`ServiceTokens::call_peer`]), so the list can
//! lead with a token the peer does not know yet. A token is rotated without an outage and in
//! any order of restarts (docs/OPERATIONS.md "Rotating the service token"): `NEW,OLD` on one side, then on
//! the other, then `NEW` everywhere.
//!
//! The fallback is bounded, because whatever answers 401 at a peer's URL is sent the next
//! token: it runs only on a peer's first 401 in a [`ROTATION_WINDOW_MS`] (a later 401 in the
//! window is the call's answer), and every token of one call shares the caller's one budget
//! (each try gets what is left of it, never a fresh timeout), so a call never takes longer
//! than it would with one token.
//!
//! Floor 1: plain values. Every comparison runs over SHA-256 digests of fixed length, and every
//! accepted token is compared, so neither the length of a token nor which one matched shows in
//! the time an answer takes.
//!
//! Must never: print a token (`Debug` is masked), or stop comparing at the first match.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::clock::SharedClock;

/// The accepted tokens are few: a rotation needs two.
pub const MAX_TOKENS: usize = 8;

/// Peers remembered as taking a token other than the first, at most: the fleet's cells (or
/// directors) in the middle of a rotation. Past it the memory starts again (each peer then costs
/// one more 401 on its next call), so a long-running director never grows it without bound.
pub const MAX_REMEMBERED_PEERS: usize = 4096;

/// A peer is tried with the other tokens only on its first 401 in this window (one minute: a
/// rotation's steps are deploys, minutes apart; a heartbeat or poll that meets a 401 inside the
/// window waits at most this long for the next walk).
pub const ROTATION_WINDOW_MS: u64 = 60_000;

/// What is remembered of one peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct PeerMemory {
    /// The index of the token it last took.
    preferred: usize,
    /// When the other tokens were last tried on it (monotonic ms).
    walked_at_ms: Option<u64>,
}

#[derive(Clone)]
pub struct ServiceTokens {
    /// In the order given: the first is sent first.
    tokens: Vec<String>,
    accepted: Vec<[u8; 32]>,
    /// Per peer, the token it last took and when the others were last tried. Shared by the
    /// clones, so the feed poller and the bookings of one director learn together.
    peers: Arc<Mutex<HashMap<String, PeerMemory>>>,
    /// Budgets and the rotation window run on its monotonic time.
    clock: SharedClock,
}

impl PartialEq for ServiceTokens {
    fn eq(&self, other: &ServiceTokens) -> bool {
        self.tokens == other.tokens
    }
}

impl Eq for ServiceTokens {}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Equal digests, without an early exit on the first differing byte.
fn digests_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl ServiceTokens {
    /// Parses the comma list (items trimmed). `Err` says what is accepted.
    pub fn parse(raw: &str) -> Result<ServiceTokens, String> {
        let tokens: Vec<&str> = raw.split(',').map(str::trim).collect();
        if tokens.iter().any(|token| token.is_empty()) {
            return Err(format!(
                "a comma list of 1 to {MAX_TOKENS} non-empty tokens (the first is sent, any is \
                 accepted)"
            ));
        }
        if tokens.len() > MAX_TOKENS {
            return Err(format!(
                "at most {MAX_TOKENS} tokens in the comma list (the first is sent, any is accepted)"
            ));
        }
        Ok(ServiceTokens::from_list(
            tokens.iter().map(|token| token.to_string()).collect(),
        ))
    }

    /// One token, sent and accepted (the combined role's generated in-process token, tests).
    pub fn single(token: impl Into<String>) -> ServiceTokens {
        ServiceTokens::from_list(vec![token.into()])
    }

    fn from_list(tokens: Vec<String>) -> ServiceTokens {
        let accepted = tokens.iter().map(|token| digest(token)).collect();
        ServiceTokens {
            tokens,
            accepted,
            peers: Arc::default(),
            clock: crate::clock::system(),
        }
    }

    /// The same tokens on another clock (tests drive budgets and windows with a manual one).
    pub fn with_clock(mut self, clock: SharedClock) -> ServiceTokens {
        self.clock = clock;
        self
    }

    /// The token this process sends first.
    pub fn sent(&self) -> &str {
        self.tokens.first().map(String::as_str).unwrap_or("")
    }

    /// Calls `peer` with `call(token, time_left)`, all within `budget`: starting with the
    /// token the peer last took (the first token until it has taken another), and moving to the
    /// next only while the peer refuses the token (`refused`, an HTTP 401), only on the peer's
    /// first refusal in a [`ROTATION_WINDOW_MS`], and only while time is left. Each try gets
    /// what is left of the budget (the first at least 1 ms). Any other answer, success or
    /// failure, is the call's answer; so is the last refusal. A peer that took a token other
    /// than the first is remembered (and logged once) so the next call starts there.
    pub fn call_peer<T, E>(
        &self,
        peer: &str,
        budget: Duration,
        mut call: impl FnMut(&str, Duration) -> Result<T, Box<E>>,
        refused: impl Fn(&E) -> bool,
    ) -> Result<T, Box<E>> {
        let started = self.clock.monotonic_ms();
        let deadline = started.saturating_add(budget.as_millis() as u64);
        let count = self.tokens.len().max(1);
        let start = self.memory(peer).preferred % count;
        let mut tried = 0;
        loop {
            let index = (start + tried) % count;
            let left = deadline.saturating_sub(self.clock.monotonic_ms()).max(1);
            let token = self.tokens.get(index).map(String::as_str).unwrap_or("");
            let result = call(token, Duration::from_millis(left));
            match &result {
                Ok(_) => {
                    self.remember(peer, index);
                    return result;
                }
                Err(error) if refused(error) && tried + 1 < count => {
                    let now = self.clock.monotonic_ms();
                    if now >= deadline || (tried == 0 && !self.may_walk(peer, now)) {
                        return result;
                    }
                    tried += 1;
                }
                Err(_) => return result,
            }
        }
    }

    /// [`ServiceTokens::call_peer`] for one HTTP request: `send(token, time_left)` sends it with
    /// `Authorization: Bearer <token>` and the request's timeout at `time_left`; a 401 may move
    /// on to the next token. Errors stay boxed (a `ureq::Error` is large); callers unbox them
    /// where they match.
    pub fn call_http(
        &self,
        peer: &str,
        budget: Duration,
        send: impl FnMut(&str, Duration) -> Result<ureq::Response, Box<ureq::Error>>,
    ) -> Result<ureq::Response, Box<ureq::Error>> {
        self.call_peer(peer, budget, send, is_unauthorized)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, PeerMemory>> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn memory(&self, peer: &str) -> PeerMemory {
        self.lock().get(peer).copied().unwrap_or_default()
    }

    /// Bounded: past [`MAX_REMEMBERED_PEERS`] the memory starts again.
    fn update(&self, peer: &str, change: impl FnOnce(&mut PeerMemory)) {
        let mut peers = self.lock();
        if peers.len() >= MAX_REMEMBERED_PEERS && !peers.contains_key(peer) {
            peers.clear();
        }
        let memory = peers.entry(peer.to_string()).or_default();
        change(memory);
        if *memory == PeerMemory::default() {
            peers.remove(peer);
        }
    }

    /// Whether the other tokens may be tried on `peer` now (its first 401 in the window); if
    /// so, the walk is recorded.
    fn may_walk(&self, peer: &str, now_ms: u64) -> bool {
        let recent = self
            .memory(peer)
            .walked_at_ms
            .is_some_and(|at| now_ms.saturating_sub(at) < ROTATION_WINDOW_MS);
        if !recent {
            self.update(peer, |memory| memory.walked_at_ms = Some(now_ms));
        }
        !recent
    }

    fn remember(&self, peer: &str, index: usize) {
        let before = self.memory(peer).preferred;
        if index == before {
            return;
        }
        self.update(peer, |memory| memory.preferred = index);
        log::info!(
            "orca_relay_service_token_fallback peer={peer} token_index={index} tokens={}",
            self.tokens.len()
        );
    }

    /// How many tokens are accepted.
    pub fn len(&self) -> usize {
        self.accepted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.accepted.is_empty()
    }

    /// True when the `Authorization` header is `Bearer <one of the tokens>` (the scheme in any
    /// case, [`bearer_credentials`]). Compares the presented token's digest with every accepted
    /// digest, whatever matched first.
    pub fn accepts(&self, authorization: Option<&str>) -> bool {
        let presented = bearer_credentials(authorization).unwrap_or("");
        let presented = digest(presented);
        let mut matched = false;
        for accepted in &self.accepted {
            // `|` rather than `||`: every comparison runs.
            matched |= digests_equal(accepted, &presented);
        }
        matched
    }
}

/// The credentials of an `Authorization: Bearer <token>` header: the scheme is matched in any
/// case and followed by one or more spaces (RFC 9110 §11.1, §11.4; RFC 6750 §2.1). `None` for
/// another scheme, a missing header or an empty token.
pub fn bearer_credentials(authorization: Option<&str>) -> Option<&str> {
    let (scheme, rest) = authorization?.split_once(' ')?;
    let token = rest.trim_start_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// A peer's HTTP answer that refuses the token (401): [`ServiceTokens::call_peer`] tries the
/// next one.
pub fn is_unauthorized(error: &ureq::Error) -> bool {
    matches!(error, ureq::Error::Status(401, _))
}

impl fmt::Debug for ServiceTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ServiceTokens({} accepted, masked)", self.accepted.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_is_sent_and_any_is_accepted() {
        let tokens = ServiceTokens::parse(" new-token , old-token ").unwrap();
        assert_eq!(tokens.sent(), "new-token");
        assert_eq!(tokens.len(), 2);
        assert!(tokens.accepts(Some("Bearer new-token")));
        assert!(tokens.accepts(Some("Bearer old-token")));
        // The scheme is case-insensitive and followed by one or more spaces (RFC 9110 §11).
        for accepted in [
            "bearer new-token",
            "BEARER old-token",
            "bEaReR new-token",
            "Bearer  new-token",
        ] {
            assert!(tokens.accepts(Some(accepted)), "{accepted:?}");
        }
        for refused in [
            None,
            Some(""),
            Some("Bearer "),
            Some("Bearer"),
            Some("Bearer new-toke"),
            Some("Bearer new-token,old-token"),
            Some("Bearernew-token"),
            Some("Basic new-token"),
            Some("new-token"),
        ] {
            assert!(!tokens.accepts(refused), "{refused:?}");
        }
    }

    #[test]
    fn a_single_token_behaves_as_before() {
        let tokens = ServiceTokens::parse("s3cret").unwrap();
        assert_eq!(tokens, ServiceTokens::single("s3cret"));
        assert!(tokens.accepts(Some("Bearer s3cret")));
        assert!(!tokens.accepts(Some("Bearer s3cre")));
    }

    #[test]
    fn empty_items_and_long_lists_are_refused() {
        for bad in ["a,", ",a", "a,,b", " , "] {
            assert!(ServiceTokens::parse(bad).is_err(), "{bad:?}");
        }
        let nine = ["t"; MAX_TOKENS + 1].join(",");
        assert!(ServiceTokens::parse(&nine).is_err());
        let eight = ["t"; MAX_TOKENS].join(",");
        assert!(ServiceTokens::parse(&eight).is_ok());
    }

    /// A fake peer that accepts `accepted` and answers 401 (`Err(401)`) to anything else.
    fn peer<'a>(
        accepted: &'a str,
        seen: &'a std::cell::RefCell<Vec<String>>,
    ) -> impl FnMut(&str, Duration) -> Result<(), Box<u16>> + 'a {
        move |token: &str, _left| {
            seen.borrow_mut().push(token.to_string());
            if token == accepted {
                Ok(())
            } else {
                Err(Box::new(401))
            }
        }
    }

    const BUDGET: Duration = Duration::from_secs(2);

    fn manual(tokens: &str) -> (ServiceTokens, Arc<crate::clock::ManualClock>) {
        let clock = crate::clock::ManualClock::starting_at(1_000_000);
        let tokens = ServiceTokens::parse(tokens)
            .unwrap()
            .with_clock(clock.clone());
        (tokens, clock)
    }

    #[test]
    fn a_refused_first_token_is_followed_by_the_next_and_remembered_per_peer() {
        let (tokens, clock) = manual("new,old");
        let seen = std::cell::RefCell::new(Vec::new());
        let refused = |status: &u16| *status == 401;
        // A peer still on the old token: refused once, then the old one, remembered.
        assert_eq!(
            tokens.call_peer("cell-a", BUDGET, peer("old", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["new", "old"]);
        seen.borrow_mut().clear();
        let clone = tokens.clone();
        assert_eq!(
            clone.call_peer("cell-a", BUDGET, peer("old", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["old"], "the clones share what was learnt");
        // Another peer, already on the new one, is asked with the first token.
        seen.borrow_mut().clear();
        assert_eq!(
            tokens.call_peer("cell-b", BUDGET, peer("new", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["new"]);
        // The first peer moves on to the new token a rotation step later: its remembered one is
        // refused, the next (wrapping around) is taken and remembered.
        clock.advance(ROTATION_WINDOW_MS);
        seen.borrow_mut().clear();
        assert_eq!(
            tokens.call_peer("cell-a", BUDGET, peer("new", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["old", "new"]);
        seen.borrow_mut().clear();
        assert_eq!(
            tokens.call_peer("cell-a", BUDGET, peer("new", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["new"]);
    }

    #[test]
    fn only_a_refusal_moves_on_and_only_once_a_window() {
        let (tokens, clock) = manual("a,b,c");
        let calls = std::cell::Cell::new(0);
        let always = |status: u16| {
            let calls = &calls;
            move |_: &str, _: Duration| -> Result<(), Box<u16>> {
                calls.set(calls.get() + 1);
                Err(Box::new(status))
            }
        };
        let refused = |status: &u16| *status == 401;
        // Every token once on the peer's first 401 of the window.
        let answer = tokens.call_peer("p", BUDGET, always(401), refused);
        assert_eq!((answer, calls.get()), (Err(Box::new(401)), 3));
        // Within the window a 401 is the answer: no token is sent to it again.
        calls.set(0);
        clock.advance(ROTATION_WINDOW_MS - 1);
        let answer = tokens.call_peer("p", BUDGET, always(401), refused);
        assert_eq!((answer, calls.get()), (Err(Box::new(401)), 1));
        // Another peer has its own window; the first gets a new one once it has passed.
        calls.set(0);
        let answer = tokens.call_peer("q", BUDGET, always(401), refused);
        assert_eq!((answer, calls.get()), (Err(Box::new(401)), 3));
        calls.set(0);
        clock.advance(1);
        let answer = tokens.call_peer("p", BUDGET, always(401), refused);
        assert_eq!((answer, calls.get()), (Err(Box::new(401)), 3));
        // A 503 is the peer's answer.
        calls.set(0);
        let answer = tokens.call_peer("r", BUDGET, always(503), refused);
        assert_eq!((answer, calls.get()), (Err(Box::new(503)), 1));
        let (single, _) = manual("only");
        calls.set(0);
        let answer = single.call_peer("p", BUDGET, always(401), refused);
        assert_eq!((answer, calls.get()), (Err(Box::new(401)), 1));
    }

    #[test]
    fn every_token_of_a_call_shares_one_budget() {
        let (tokens, clock) = manual("a,b,c");
        let lefts = std::cell::RefCell::new(Vec::new());
        // Each try takes 700 ms of a 1 s budget and is refused.
        let slow = |_: &str, left: Duration| -> Result<(), Box<u16>> {
            lefts.borrow_mut().push(left);
            clock.advance(700);
            Err(Box::new(401))
        };
        let answer = tokens.call_peer("p", Duration::from_secs(1), slow, |s| *s == 401);
        assert_eq!(answer, Err(Box::new(401)));
        assert_eq!(
            *lefts.borrow(),
            [Duration::from_millis(1_000), Duration::from_millis(300)],
            "the second token gets what is left; there is no time for the third"
        );
    }

    #[test]
    fn debug_never_prints_a_token() {
        let tokens = ServiceTokens::parse("visible-secret,other-secret").unwrap();
        let debug = format!("{tokens:?}");
        assert!(!debug.contains("secret"), "{debug}");
        assert!(debug.contains("2 accepted"));
    }
}
