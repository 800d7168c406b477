//! Readiness.
