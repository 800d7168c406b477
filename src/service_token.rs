//! The fleet's service tokens (`ORCA_RELAY_SERVICE_TOKEN`): the shared bearer secret of every
//! director↔cell call (registration, heartbeats, bookings, seat-feed polls, the admin API).
//!
//! The variable is a comma list. The **first** token is the one this process sends; **any** of
//! them is accepted. So a token is rotated without an outage in three rolls of the fleet
//! (README "Rotating the service token"): `OLD,NEW` everywhere (accept the new one), then
//! `NEW,OLD` (send it), then `NEW` (drop the old one).
//!
//! Floor 1: plain values. Every comparison runs over SHA-256 digests of fixed length, and every
//! accepted token is compared, so neither the length of a token nor which one matched shows in
//! the time an answer takes.
//!
//! Must never: print a token (`Debug` is masked), or stop comparing at the first match.

use std::fmt;

use sha2::{Digest, Sha256};

/// The accepted tokens are few: a rotation needs two.
pub const MAX_TOKENS: usize = 8;

#[derive(Clone, PartialEq, Eq)]
pub struct ServiceTokens {
    sent: String,
    accepted: Vec<[u8; 32]>,
}

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
        Ok(ServiceTokens {
            sent: tokens[0].to_string(),
            accepted: tokens.iter().map(|token| digest(token)).collect(),
        })
    }

    /// One token, sent and accepted (the combined role's generated in-process token, tests).
    pub fn single(token: impl Into<String>) -> ServiceTokens {
        let sent = token.into();
        let accepted = vec![digest(&sent)];
        ServiceTokens { sent, accepted }
    }

    /// The token this process sends.
    pub fn sent(&self) -> &str {
        &self.sent
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

    #[test]
    fn debug_never_prints_a_token() {
        let tokens = ServiceTokens::parse("visible-secret,other-secret").unwrap();
        let debug = format!("{tokens:?}");
        assert!(!debug.contains("secret"), "{debug}");
        assert!(debug.contains("2 accepted"));
    }
}
