-- orca-relay schema, version 3, PostgreSQL: the database's own clock (SPEC §11 "Slot liveness",
-- "Fleet membership"). Rows that different machines compare (a cell's admit-effective row that
-- the slot claim counts, heartbeats, registrations, the operator's admit-mode record) are
-- stamped and judged with relay_now_ms() inside the statement, never with a process's clock:
-- a cell ten minutes fast or slow then holds and frees slots exactly as one that agrees.
-- now() is the transaction's start, so one transaction stamps and compares with one instant.
-- Idempotent (CREATE OR REPLACE, IF NOT EXISTS) besides being recorded in schema_migrations.

CREATE OR REPLACE FUNCTION relay_now_ms() RETURNS BIGINT
    LANGUAGE SQL STABLE
    AS $$ SELECT (EXTRACT(EPOCH FROM now()) * 1000)::BIGINT $$;

-- The director's sweep deletes leases long past their expiry.
CREATE INDEX IF NOT EXISTS relay_assignment_activity_leases_by_expiry
    ON relay_assignment_activity_leases (expires_at);
