//! The cell model.
pub mod handshake;
pub mod switch;
