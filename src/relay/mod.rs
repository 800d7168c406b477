//! The data plane: the `acceptor` thread (the pending plane), one `relay-<id>` thread per
//! authenticated control and phone until its pair is spliced, and the splice workers.
//!
//! Every connection is **pending** from its accept until its credential is checked, whatever
//! its path (SPEC §12): it lives in the acceptor's table (`pending.rs`,
//! `ORCA_RELAY_PENDING_UPGRADES_MAX`, the least progressed shed first when full: `shedding.rs`)
//! with one absolute deadline, and holds no unit of the **connection cap**, no relay thread and
//! no phone place. A desktop's credential is its token (in the head); a phone's and a data leg's
//! is their first frame (an invite, a ticket), read by the acceptor too. Only an authenticated
//! connection takes a unit (and, for a control or a phone, a thread permit and its relay
//! thread), so the cap counts admitted sockets only and nobody without a credential can hold a
//! desktop's place. Every refusal is counted and answered: an HTTP status before the upgrade, a
//! close code after; what refused and closing connections hold while they linger is bounded
//! (`closing.rs`).
//!
//! A panic in a relay thread is caught at the top of the thread: it costs that connection a
//! close (4429), never the process.

pub mod attach;
pub mod buffer_budget;
pub mod closing;
pub mod context;
pub mod control;
pub mod control_reader;
pub mod data;
pub mod frames;
pub mod hold;
pub mod metrics;
pub mod park;
pub mod pending;
pub mod phone;
pub mod refuse;
pub mod shedding;
pub mod socket;
pub mod splice;
pub mod splice_reader;
pub mod thread;
pub mod upgrade;
