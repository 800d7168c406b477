//! The dead-man: window, pause guard, watchdog, admit-effective writer and claim loop, re-registration.
pub mod claim_loop;
pub mod pause;
pub mod reregister;
pub mod watchdog;
pub mod window;
pub mod writer;
