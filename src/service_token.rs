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
//! Floor 1: plain values. Every comparison runs over SHA-256 digests of fixed length, and every
//! accepted token is compared, so neither the length of a token nor which one matched shows in
//! the time an answer takes.
//!
//! Must never: print a token (`Debug` is masked), or stop comparing at the first match.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// The accepted tokens are few: a rotation needs two.
pub const MAX_TOKENS: usize = 8;

/// Peers remembered as taking a token other than the first, at most: the fleet's cells (or
/// directors) in the middle of a rotation. Past it the memory starts again (each peer then costs
/// one more 401 on its next call), so a long-running director never grows it without bound.
pub const MAX_REMEMBERED_PEERS: usize = 4096;

#[derive(Clone)]
pub struct ServiceTokens {
    /// In the order given: the first is sent first.
    tokens: Vec<String>,
    accepted: Vec<[u8; 32]>,
    /// Per peer, the index of the token it last took when that was not the first. Shared by the
    /// clones, so the feed poller and the bookings of one director learn together.
    preferred: Arc<Mutex<HashMap<String, usize>>>,
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
            preferred: Arc::default(),
        }
    }

    /// The token this process sends first.
    pub fn sent(&self) -> &str {
        self.tokens.first().map(String::as_str).unwrap_or("")
    }

    /// Calls `peer` with `call(token)`, starting with the token the peer last took (the first
    /// token until it has taken another) and moving to the next only while the peer answers
    /// that it refuses the token (`refused`, an HTTP 401). Any other answer, success or failure,
    /// is the call's answer; the last refusal is, when every token was refused. A peer that
    /// took a token other than the first is remembered (and logged once) so the next call
    /// starts there.
    pub fn call_peer<T, E>(
        &self,
        peer: &str,
        mut call: impl FnMut(&str) -> Result<T, Box<E>>,
        refused: impl Fn(&E) -> bool,
    ) -> Result<T, Box<E>> {
        let count = self.tokens.len().max(1);
        let start = self.remembered(peer).unwrap_or(0) % count;
        let mut tried = 0;
        loop {
            let index = (start + tried) % count;
            let result = call(self.tokens.get(index).map(String::as_str).unwrap_or(""));
            match &result {
                Err(error) if refused(error) && tried + 1 < count => tried += 1,
                Ok(_) => {
                    self.remember(peer, index);
                    return result;
                }
                Err(_) => return result,
            }
        }
    }

    /// [`ServiceTokens::call_peer`] for one HTTP request: `send(token)` sends it with
    /// `Authorization: Bearer <token>`; a 401 moves on to the next token. Errors stay boxed (a
    /// `ureq::Error` is large); callers unbox them where they match.
    pub fn call_http(
        &self,
        peer: &str,
        send: impl FnMut(&str) -> Result<ureq::Response, Box<ureq::Error>>,
    ) -> Result<ureq::Response, Box<ureq::Error>> {
        self.call_peer(peer, send, is_unauthorized)
    }

    fn remembered(&self, peer: &str) -> Option<usize> {
        let preferred = self.preferred.lock().unwrap_or_else(|e| e.into_inner());
        preferred.get(peer).copied()
    }

    fn remember(&self, peer: &str, index: usize) {
        let mut preferred = self.preferred.lock().unwrap_or_else(|e| e.into_inner());
        let before = preferred.get(peer).copied().unwrap_or(0);
        if index == before {
            return;
        }
        if index == 0 {
            preferred.remove(peer);
        } else {
            if preferred.len() >= MAX_REMEMBERED_PEERS {
                preferred.clear();
            }
            preferred.insert(peer.to_string(), index);
        }
        drop(preferred);
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

    /// True when the `Authorization` header is `Bearer <one of the tokens>`. Compares the
    /// presented token's digest with every accepted digest, whatever matched first.
    pub fn accepts(&self, authorization: Option<&str>) -> bool {
        let presented = authorization
            .and_then(|value| value.strip_prefix("Bearer "))
            .unwrap_or("");
        let presented = digest(presented);
        let mut matched = false;
        for accepted in &self.accepted {
            // `|` rather than `||`: every comparison runs.
            matched |= digests_equal(accepted, &presented);
        }
        matched
    }
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
        for refused in [
            None,
            Some(""),
            Some("Bearer "),
            Some("Bearer new-toke"),
            Some("Bearer new-token,old-token"),
            Some("Bearer  new-token"),
            Some("bearer new-token"),
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
    ) -> impl FnMut(&str) -> Result<(), Box<u16>> + 'a {
        move |token: &str| {
            seen.borrow_mut().push(token.to_string());
            if token == accepted {
                Ok(())
            } else {
                Err(Box::new(401))
            }
        }
    }

    #[test]
    fn a_refused_first_token_is_followed_by_the_next_and_remembered_per_peer() {
        let tokens = ServiceTokens::parse("new,old").unwrap();
        let seen = std::cell::RefCell::new(Vec::new());
        let refused = |status: &u16| *status == 401;
        // A peer still on the old token: refused once, then the old one, remembered.
        assert_eq!(
            tokens.call_peer("cell-a", peer("old", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["new", "old"]);
        seen.borrow_mut().clear();
        let clone = tokens.clone();
        assert_eq!(
            clone.call_peer("cell-a", peer("old", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["old"], "the clones share what was learnt");
        // Another peer, already on the new one, is asked with the first token.
        seen.borrow_mut().clear();
        assert_eq!(
            tokens.call_peer("cell-b", peer("new", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["new"]);
        // The first peer moves on to the new token: its remembered one is refused, the next
        // (wrapping around) is taken and remembered.
        seen.borrow_mut().clear();
        assert_eq!(
            tokens.call_peer("cell-a", peer("new", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["old", "new"]);
        seen.borrow_mut().clear();
        assert_eq!(
            tokens.call_peer("cell-a", peer("new", &seen), refused),
            Ok(())
        );
        assert_eq!(*seen.borrow(), ["new"]);
    }

    #[test]
    fn only_a_refusal_moves_on_and_every_token_is_tried_at_most_once() {
        let tokens = ServiceTokens::parse("a,b,c").unwrap();
        let mut calls = 0;
        let answer: Result<(), Box<u16>> = tokens.call_peer(
            "p",
            |_| {
                calls += 1;
                Err(Box::new(401))
            },
            |status| *status == 401,
        );
        assert_eq!((answer, calls), (Err(Box::new(401)), 3));
        let mut calls = 0;
        let answer: Result<(), Box<u16>> = tokens.call_peer(
            "p",
            |_| {
                calls += 1;
                Err(Box::new(503))
            },
            |status| *status == 401,
        );
        assert_eq!(
            (answer, calls),
            (Err(Box::new(503)), 1),
            "a 503 is the peer's answer"
        );
        let single = ServiceTokens::single("only");
        let mut calls = 0;
        let answer: Result<(), Box<u16>> = single.call_peer(
            "p",
            |_| {
                calls += 1;
                Err(Box::new(401))
            },
            |status| *status == 401,
        );
        assert_eq!((answer, calls), (Err(Box::new(401)), 1));
    }

    #[test]
    fn debug_never_prints_a_token() {
        let tokens = ServiceTokens::parse("visible-secret,other-secret").unwrap();
        let debug = format!("{tokens:?}");
        assert!(!debug.contains("secret"), "{debug}");
        assert!(debug.contains("2 accepted"));
    }
}
