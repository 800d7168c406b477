//! The director: placements (`/v1/assign`) and, in the director role, cell registration,
//! heartbeats and the seat-feed poller.

pub mod assign;
