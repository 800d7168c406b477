//! The cell model.
pub mod admission;
pub mod bookings;
pub mod contact;
pub mod handshake;
pub mod heartbeat;
pub mod incarnation;
pub mod internal_api;
pub mod mode;
pub mod seats;
pub mod state;
pub mod status_report;
pub mod switch;
