//! Dead-man contact (SPEC §5.5): the moment the cell last heard from a director that books on
//! it, either a real booking or a `reserver=1` seat-feed poll.
//!
//! Owns: one timestamp, behind an atomic, shared by cheap clones.
//! Written by: the HTTP workers, through `cell::internal_api`. Read by: the `watchdog` thread,
//! which feeds it into the dead-man window as `last_contact_ms`.
//! Must never: go backwards (two workers racing with slightly different "now"s keep the later
//! one), or call into `dead_man/` (the arrow points from `dead_man` to `cell`, never back).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The last dead-man contact. Clones share the same timestamp.
#[derive(Debug, Clone, Default)]
pub struct Contact {
    /// `0` = never; otherwise the contact time plus one, so a contact at time 0 (a manual clock
    /// in a test) is still a contact.
    last_plus_one: Arc<AtomicU64>,
}

impl Contact {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a contact at `now_ms`. Never moves the timestamp backwards.
    pub fn record(&self, now_ms: u64) {
        self.last_plus_one
            .fetch_max(now_ms.saturating_add(1), Ordering::AcqRel);
    }

    /// The last contact, if any since start.
    pub fn last(&self) -> Option<u64> {
        self.last_plus_one.load(Ordering::Acquire).checked_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_contact_until_recorded_then_the_latest_wins() {
        let contact = Contact::new();
        assert_eq!(contact.last(), None);
        contact.record(0);
        assert_eq!(contact.last(), Some(0), "a contact at time 0 is a contact");
        let shared = contact.clone();
        shared.record(5_000);
        assert_eq!(contact.last(), Some(5_000), "clones share the timestamp");
        contact.record(4_000);
        assert_eq!(
            contact.last(),
            Some(5_000),
            "an older now never moves it back"
        );
    }
}
