//! orca-relay: a WebSocket relay for desktops and their paired phones.
//!
//! See `ARCHITECTURE.md` for the code map, the floors, the threads and the invariants. Modules
//! are layered: lower floors never import higher ones (`tests/layering.rs` fails on a circle).

// Floor 1: plain values and helpers, and what outlives a process (`carry`).
pub mod budget;
pub mod capacity;
pub mod carry;
pub mod clock;
pub mod config;
pub mod database_tls;
pub mod liveness;
pub mod local_file;
pub mod logging;
pub mod metrics;
pub mod outbound;
pub mod pause_clock;
pub mod protocol;
pub mod service_token;
pub mod threads;
pub mod wake;

// Floor 2: the only SQL, token checks, HTTP plumbing, the handover's transport, process
// lifecycle.
pub mod auth;
pub mod crash_store;
pub mod handover;
pub mod http;
pub mod lifecycle;
pub mod store;

// Floor 3: readiness and the cell's model.
pub mod cell;
pub mod readiness;

// Floor 4: the data plane, the dead-man, the director.
pub mod dead_man;
pub mod director;
pub mod relay;

// Floors 5-7: role wiring (`roles`), the commands, and `cli` above them.
pub mod cli;
pub mod client;
pub mod fleet_status;
pub mod handover_command;
pub mod roles;
pub mod switch_tool;
