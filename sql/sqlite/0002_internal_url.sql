-- orca-relay schema, version 2, SQLite: the base URL of a cell's HTTP listener, where the
-- director reaches its `/internal/*` API (SPEC §5.4). `cell_url` is the public WebSocket URL
-- desktops and phones use; the two differ in every real deployment. Nullable: a cell that
-- registered without one (an older image) is still placed on the database path, but it can be
-- neither booked nor polled.
-- SQLite has no ADD COLUMN IF NOT EXISTS: this file runs exactly once, inside the same
-- BEGIN IMMEDIATE transaction that records version 2 in schema_migrations.

ALTER TABLE relay_cells ADD COLUMN internal_url TEXT;
