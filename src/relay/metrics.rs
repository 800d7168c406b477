//! The data plane's counters and gauges (SPEC §5.6): bytes and frames spliced, closes by code,
//! admissions by path and outcome, refusals and sheds of the pending plane.

use super::shedding::Progress;
use crate::metrics::{Counter, Gauge, Registry};
use crate::protocol::CloseCode;

const SHED_HELP: &str = "Pending connections (no credential checked yet) shed to bound the table or their source, by how far they had got.";
const SOURCE_FULL_HELP: &str = "Pending connections closed because their source held ORCA_RELAY_PENDING_PER_SOURCE_MAX: that source's least progressed, or the newcomer.";

/// Counters of the data plane (SPEC §5.6).
#[derive(Clone)]
pub struct RelayMetrics {
    registry: Registry,
    pub bytes_phone_to_host: Counter,
    pub bytes_host_to_phone: Counter,
    pub frames_phone_to_host: Counter,
    pub frames_host_to_phone: Counter,
}

impl RelayMetrics {
    pub fn new(registry: &Registry) -> Self {
        let bytes = |direction| {
            registry.counter(
                "orca_relay_splice_bytes_total",
                "Bytes spliced, by direction.",
                &[("direction", direction)],
            )
        };
        let frames = |direction| {
            registry.counter(
                "orca_relay_splice_frames_total",
                "Frames spliced, by direction.",
                &[("direction", direction)],
            )
        };
        for code in CloseCode::ALL {
            registry.counter(
                "orca_relay_closes_total",
                "WebSocket closes sent, by code.",
                &[("code", &code.code().to_string())],
            );
        }
        for path in ["booking", "memory", "database"] {
            registry.counter(
                "orca_relay_admission_sql_statements_total",
                "SQL statements run while admitting hellos, by admission path.",
                &[("path", path)],
            );
        }
        // Every admission series exists from the start, so a scraper sees the family at zero.
        for (path, outcome) in [
            ("booking", "admitted"),
            ("memory", "admitted"),
            ("database", "admitted"),
            ("database", "wrong_cell"),
            ("database", "error"),
        ] {
            registry.counter(
                "orca_relay_admissions_total",
                "Desktop hellos by admission path and outcome.",
                &[("path", path), ("outcome", outcome)],
            );
        }
        // Every stage a pending connection can be shed at, from the start.
        for stage in Progress::ALL {
            registry.counter(
                "orca_relay_ws_pending_upgrades_shed_total",
                SHED_HELP,
                &[("stage", stage.label())],
            );
        }
        registry.counter(
            "orca_relay_ws_pending_source_full_total",
            SOURCE_FULL_HELP,
            &[],
        );
        for kind in ["control", "phone", "data"] {
            registry.gauge(
                "orca_relay_connections",
                "Open WebSocket connections, by kind.",
                &[("kind", kind)],
            );
        }
        RelayMetrics {
            registry: registry.clone(),
            bytes_phone_to_host: bytes("phone_to_host"),
            bytes_host_to_phone: bytes("host_to_phone"),
            frames_phone_to_host: frames("phone_to_host"),
            frames_host_to_phone: frames("host_to_phone"),
        }
    }

    pub fn close(&self, code: CloseCode) {
        self.registry
            .counter(
                "orca_relay_closes_total",
                "WebSocket closes sent, by code.",
                &[("code", &code.code().to_string())],
            )
            .inc();
    }

    pub fn connections(&self, kind: &str) -> Gauge {
        self.registry.gauge(
            "orca_relay_connections",
            "Open WebSocket connections, by kind.",
            &[("kind", kind)],
        )
    }

    /// A pending connection shed at `stage` (a `shedding::Progress` label) to bound the table or
    /// its source.
    pub fn pending_shed(&self, stage: &str) {
        self.registry
            .counter(
                "orca_relay_ws_pending_upgrades_shed_total",
                SHED_HELP,
                &[("stage", stage)],
            )
            .inc();
    }

    /// A pending connection closed because its source held its bound.
    pub fn pending_source_full(&self) {
        self.registry
            .counter(
                "orca_relay_ws_pending_source_full_total",
                SOURCE_FULL_HELP,
                &[],
            )
            .inc();
    }

    pub fn dropped_at_accept(&self, reason: &str) {
        self.registry
            .counter(
                "orca_relay_ws_connections_dropped_total",
                "WebSocket connections closed at accept without an answer, by reason.",
                &[("reason", reason)],
            )
            .inc();
    }

    /// An attached pair no splice worker could take (closed 4429).
    pub fn splice_refused(&self, reason: &str) {
        self.registry
            .counter(
                "orca_relay_splice_refused_total",
                "Attached pairs no splice worker could take (both legs closed 4429), by reason.",
                &[("reason", reason)],
            )
            .inc();
    }

    pub fn upgrade_refused(&self, status: u16, reason: &str) {
        self.registry
            .counter(
                "orca_relay_upgrades_refused_total",
                "Upgrades refused with an HTTP status, by status and reason.",
                &[("status", &status.to_string()), ("reason", reason)],
            )
            .inc();
    }

    /// SQL statements run while admitting hellos, by admission path: memory and booking
    /// admissions must stay at zero (SPEC §5.3).
    pub fn admission_statements(&self, path: &str, statements: u64) {
        self.registry
            .counter(
                "orca_relay_admission_sql_statements_total",
                "SQL statements run while admitting hellos, by admission path.",
                &[("path", path)],
            )
            .add(statements);
    }

    pub fn admission(&self, path: &str, outcome: &str) {
        self.registry
            .counter(
                "orca_relay_admissions_total",
                "Desktop hellos by admission path and outcome.",
                &[("path", path), ("outcome", outcome)],
            )
            .inc();
    }
}
