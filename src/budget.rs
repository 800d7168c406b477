//! The connection budget tool (SPEC §10).
