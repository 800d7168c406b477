//! The dead-man: window, watchdog, admit-effective writer and claim loop, re-registration.
pub mod claim_loop;
pub mod reregister;
pub mod watchdog;
pub mod window;
pub mod writer;
