//! The director (SPEC §6.2): placements (`/v1/assign`), the admin API cells and operators call
//! (registration, heartbeats, admit modes), and the seat-feed poller that keeps reserve cells
//! armed.
//!
//! - [`placement`]: the pure decision (pin, booking, database path, exhausted).
//! - [`assign`]: `POST /v1/assign`, applying the decision against the store and the cells.
//! - [`admin`]: `/v1/admin/*` behind the service token.
//! - [`feed_poller`]: the `feed-poller` thread and the [`feed_poller::FeedBoard`] it fills.

pub mod admin;
pub mod assign;
pub mod feed_poller;
pub mod membership;
pub mod placement;
