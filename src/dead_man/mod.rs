//! The dead-man.
pub mod window;
pub mod writer;
