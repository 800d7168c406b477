//! The dead-man window.
