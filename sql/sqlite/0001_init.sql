-- orca-relay schema, version 1 (SPEC §6.1), SQLite.
-- The same tables and columns as sql/postgres/0001_init.sql. Times are ms since the Unix epoch.
-- Every statement is idempotent; the store runs this file inside one BEGIN IMMEDIATE
-- transaction, so several processes starting at once apply it one after another.
-- BIGINT columns get SQLite's INTEGER affinity (64-bit); ready is INTEGER 0 or 1 (no BOOLEAN).

CREATE TABLE IF NOT EXISTS relay_cells (
    cell_id       TEXT PRIMARY KEY,
    cell_url      TEXT NOT NULL,
    region        TEXT NOT NULL,
    incarnation   BIGINT NOT NULL,
    registered_at BIGINT NOT NULL
);

CREATE TABLE IF NOT EXISTS relay_cell_runtime (
    cell_id           TEXT PRIMARY KEY,
    cell_incarnation  BIGINT NOT NULL,
    started_at        BIGINT NOT NULL,
    ready             INTEGER NOT NULL CHECK (ready IN (0, 1)),
    connections       BIGINT NOT NULL,
    last_heartbeat_at BIGINT NOT NULL
);

-- The operator's record of a cell's switch; a missing row means 'db'.
CREATE TABLE IF NOT EXISTS relay_cell_admit_modes (
    cell_id    TEXT PRIMARY KEY,
    admit_mode TEXT NOT NULL CHECK (admit_mode IN ('db', 'reserve')),
    updated_at BIGINT NOT NULL
);

-- Written only by the cell itself (its CellAdmitEffectiveWriter, SPEC §5.5). A row saying 'db'
-- whose switch says 'reserve' holds a trip slot while it is fresh.
CREATE TABLE IF NOT EXISTS relay_cell_admit_effective (
    cell_id          TEXT PRIMARY KEY,
    cell_incarnation BIGINT NOT NULL,
    mode             TEXT NOT NULL CHECK (mode IN ('db', 'reserve')),
    updated_at       BIGINT NOT NULL
);

CREATE TABLE IF NOT EXISTS relay_assignments (
    user_id          TEXT NOT NULL,
    relay_host_id    TEXT NOT NULL,
    cell_id          TEXT NOT NULL,
    assignment_epoch BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    PRIMARY KEY (user_id, relay_host_id)
);

CREATE INDEX IF NOT EXISTS relay_assignments_by_cell ON relay_assignments (cell_id);

CREATE TABLE IF NOT EXISTS relay_assignment_activity_leases (
    activity_id   TEXT PRIMARY KEY,
    user_id       TEXT NOT NULL,
    relay_host_id TEXT NOT NULL,
    cell_id       TEXT NOT NULL,
    activity_kind TEXT NOT NULL,
    expires_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL
);
