-- orca-relay schema, version 3, SQLite: the index the director's lease sweep reads by.
-- The database's clock, relay_now_ms(), is a function the store registers on every SQLite
-- connection (SQLite has no stored functions); every process sharing the file runs on the same
-- machine, so they read one clock (SPEC §11 "Slot liveness").

CREATE INDEX IF NOT EXISTS relay_assignment_activity_leases_by_expiry
    ON relay_assignment_activity_leases (expires_at);
