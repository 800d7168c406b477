//! The cell model.
pub mod admission;
pub mod handshake;
pub mod state;
pub mod switch;
