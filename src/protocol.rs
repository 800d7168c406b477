//! Wire messages and close codes of the public WebSocket endpoints (SPEC §5.2).
//!
//! Control frames are text frames holding one JSON object with a `type`. Everything after the
//! splice starts is opaque and never parsed.

use serde::{Deserialize, Serialize};

/// WebSocket close codes the relay sends, with the names the SPEC gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseCode {
    /// Bad or expired token or credential; first frame late, not text, or malformed.
    BadOuterCredential,
    /// Phone: no active control for that host here, or the data leg never attached.
    HostOffline,
    /// The other side left; a newer control replaced this one; a silent control.
    PeerDropped,
    /// The placement does not name this cell at this epoch.
    WrongCell,
    /// Too many phones, a wedged splice, a transient internal failure.
    LimitExceeded,
    /// Draining, or the control's lease moved.
    Draining,
    /// A frame larger than the endpoint allows (RFC 6455 "message too big").
    TooBig,
    /// A frame no client may send (unmasked, reserved bits or opcodes).
    ProtocolError,
    /// Normal closure.
    Normal,
    /// The relay restarted after a crash and could not resume this connection exactly (RFC 6455
    /// "service restart"): reconnect.
    ServiceRestart,
}

impl CloseCode {
    pub fn code(self) -> u16 {
        match self {
            CloseCode::BadOuterCredential => 4401,
            CloseCode::HostOffline => 4404,
            CloseCode::PeerDropped => 4408,
            CloseCode::WrongCell => 4409,
            CloseCode::LimitExceeded => 4429,
            CloseCode::Draining => 4503,
            CloseCode::TooBig => 1009,
            CloseCode::ProtocolError => 1002,
            CloseCode::Normal => 1000,
            CloseCode::ServiceRestart => 1012,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CloseCode::BadOuterCredential => "BAD_OUTER_CREDENTIAL",
            CloseCode::HostOffline => "HOST_OFFLINE",
            CloseCode::PeerDropped => "PEER_DROPPED",
            CloseCode::WrongCell => "WRONG_CELL",
            CloseCode::LimitExceeded => "LIMIT_EXCEEDED",
            CloseCode::Draining => "DRAINING",
            CloseCode::TooBig => "MESSAGE_TOO_BIG",
            CloseCode::ProtocolError => "PROTOCOL_ERROR",
            CloseCode::Normal => "NORMAL",
            CloseCode::ServiceRestart => "SERVICE_RESTART",
        }
    }

    pub const ALL: [CloseCode; 10] = [
        CloseCode::BadOuterCredential,
        CloseCode::HostOffline,
        CloseCode::PeerDropped,
        CloseCode::WrongCell,
        CloseCode::LimitExceeded,
        CloseCode::Draining,
        CloseCode::TooBig,
        CloseCode::ProtocolError,
        CloseCode::Normal,
        CloseCode::ServiceRestart,
    ];
}

/// Frame limits (SPEC §5.2).
pub const CONTROL_MAX_FRAME_BYTES: usize = 1024 * 1024;
pub const SPLICE_MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;
/// Most phones one host may have connected at once.
pub const MAX_PHONES_PER_HOST: usize = 8;
/// Invites: lifetime and attempts.
pub const INVITE_TTL_MS: u64 = 10 * 60 * 1000;
pub const INVITE_MAX_ATTEMPTS: u32 = 5;
/// `invite-create` per control: a burst of this many, then one more every
/// [`INVITE_CREATE_REFILL_MS`]; past it the answer is `invite-refused` `rate_limited`.
pub const INVITE_CREATE_BURST: u32 = 8;
pub const INVITE_CREATE_REFILL_MS: u64 = 1_000;

/// Messages a desktop sends on its control socket.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum HostToRelay {
    #[serde(rename_all = "camelCase")]
    HostHello {
        v: u32,
        relay_host_id: String,
        assignment_epoch: i64,
    },
    Pong {
        #[serde(default)]
        t: Option<serde_json::Value>,
    },
    #[serde(rename_all = "camelCase")]
    InviteCreate { req_id: serde_json::Value },
}

/// Messages the relay sends on a control socket.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum RelayToHost {
    HostHelloAck {
        v: u32,
        generation: u64,
    },
    Ping {
        t: u64,
    },
    #[serde(rename_all = "camelCase")]
    InviteCreated {
        req_id: serde_json::Value,
        invite_token: String,
        expires_at: u64,
        max_attempts: u32,
    },
    /// An `invite-create` the relay did not honour: `rate_limited` (with the wait before the
    /// next one is allowed) or `unavailable` (no secret could be minted; try later).
    #[serde(rename_all = "camelCase")]
    InviteRefused {
        req_id: serde_json::Value,
        reason: String,
        retry_after_ms: u64,
    },
    #[serde(rename_all = "camelCase")]
    ConnOpen {
        conn_id: String,
        conn_ticket: String,
        attach_deadline_ms: u64,
    },
    #[serde(rename_all = "camelCase")]
    Drain {
        grace_ms: u64,
        recovery: String,
    },
}

/// The first frame of a phone leg.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum PhoneFirst {
    RelayAuth { v: u32, credential: String },
}

/// The first frame of a host data leg.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum DataLegFirst {
    #[serde(rename_all = "camelCase")]
    HostDataAuth {
        v: u32,
        conn_ticket: String,
        generation: u64,
    },
}

/// What the phone receives once its data leg is attached.
pub fn relay_hello_json() -> String {
    r#"{"type":"relay-hello","ok":true}"#.to_string()
}

pub fn to_json<T: Serialize>(message: &T) -> String {
    // Serialising these plain structs cannot fail.
    serde_json::to_string(message).unwrap_or_else(|_| "{}".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_parses_from_the_wire_shape() {
        let hello: HostToRelay = serde_json::from_str(
            r#"{"type":"host-hello","v":1,"relayHostId":"abcdefghijklmnop","assignmentEpoch":3}"#,
        )
        .unwrap();
        assert_eq!(
            hello,
            HostToRelay::HostHello {
                v: 1,
                relay_host_id: "abcdefghijklmnop".into(),
                assignment_epoch: 3
            }
        );
    }

    #[test]
    fn relay_messages_serialise_in_camel_case() {
        let open = to_json(&RelayToHost::ConnOpen {
            conn_id: "c1".into(),
            conn_ticket: "t".into(),
            attach_deadline_ms: 10_000,
        });
        assert_eq!(
            open,
            r#"{"type":"conn-open","connId":"c1","connTicket":"t","attachDeadlineMs":10000}"#
        );
        let ack = to_json(&RelayToHost::HostHelloAck {
            v: 1,
            generation: 2,
        });
        assert_eq!(ack, r#"{"type":"host-hello-ack","v":1,"generation":2}"#);
    }

    #[test]
    fn unknown_types_do_not_parse() {
        assert!(serde_json::from_str::<HostToRelay>(r#"{"type":"nope"}"#).is_err());
        assert!(serde_json::from_str::<PhoneFirst>(r#"{"type":"relay-auth"}"#).is_err());
    }

    #[test]
    fn close_codes_match_the_spec_table() {
        let codes: Vec<u16> = CloseCode::ALL.iter().map(|c| c.code()).collect();
        assert_eq!(
            codes,
            vec![4401, 4404, 4408, 4409, 4429, 4503, 1009, 1002, 1000, 1012]
        );
    }
}
