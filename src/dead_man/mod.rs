//! The dead-man.
pub mod window;
