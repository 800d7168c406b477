//! Token checks.
