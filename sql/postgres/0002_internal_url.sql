-- orca-relay schema, version 2, PostgreSQL: the base URL of a cell's HTTP listener, where the
-- director reaches its `/internal/*` API (SPEC §5.4). `cell_url` is the public WebSocket URL
-- desktops and phones use; the two differ in every real deployment. Nullable: a cell that
-- registered without one (an older image) is still placed on the database path, but it can be
-- neither booked nor polled.
-- Idempotent on its own (IF NOT EXISTS) besides being recorded in schema_migrations.

ALTER TABLE relay_cells ADD COLUMN IF NOT EXISTS internal_url TEXT;
