#!/usr/bin/env bash
# A throwaway PostgreSQL 15 for the tests.
#
#   eval "$(scripts/test-postgres.sh start)"   start (or find the running one) and export:
#       ORCA_RELAY_TEST_DATABASE_URL  admin URL (user postgres, trust auth) to database postgres
#       ORCA_RELAY_TEST_PGDATA        the data directory
#       ORCA_RELAY_TEST_PG_CTL        the pg_ctl binary
#       ORCA_RELAY_TEST_PG_USER       the OS user that owns the server (postgres when run as root)
#   scripts/test-postgres.sh env       print those exports again (fails if it is not running)
#   scripts/test-postgres.sh stop      stop the server and delete its data directory
#   scripts/test-postgres.sh status    say whether it runs
#
# A test that needs PostgreSQL to go away and come back starts a server of its own
# (tests/common/pg.rs: Cluster), never this shared one, so test binaries can run side by side.
# By hand, stopping and starting this one (same data, same port) is:
#   runuser -u "$ORCA_RELAY_TEST_PG_USER" -- "$ORCA_RELAY_TEST_PG_CTL" -D "$ORCA_RELAY_TEST_PGDATA" stop -m fast -w
#   runuser -u "$ORCA_RELAY_TEST_PG_USER" -- "$ORCA_RELAY_TEST_PG_CTL" -D "$ORCA_RELAY_TEST_PGDATA" \
#       -l "$ORCA_RELAY_TEST_PGDATA/log/pg_ctl.log" start -w
# (or `su postgres -c "…"`; without root, run pg_ctl directly). Pass `-l` (or give the command
# /dev/null for stdout and stderr): the server's log collector keeps the starter's stdout open,
# so a caller that reads pg_ctl's output to its end would otherwise wait forever.
#
# One server per checkout: its state file is target/test-postgres.env (override with
# ORCA_RELAY_TEST_PG_STATE). Idempotent: `start` twice reuses the running server, `stop` twice
# is harmless. The server listens on 127.0.0.1 only, on a free port, with max_connections=300
# and durability off (fsync, synchronous_commit): it is for tests, never for data.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state_file=${ORCA_RELAY_TEST_PG_STATE:-$repo/target/test-postgres.env}
command=${1:-start}

say() { echo "test-postgres: $*" >&2; }
die() { say "$*"; exit 1; }

find_bindir() {
    if [ -n "${ORCA_RELAY_PG_BINDIR:-}" ]; then
        echo "$ORCA_RELAY_PG_BINDIR"
        return
    fi
    local candidate
    for candidate in /usr/lib/postgresql/15/bin /usr/lib/postgresql/*/bin; do
        if [ -x "$candidate/initdb" ] && [ -x "$candidate/pg_ctl" ]; then
            echo "$candidate"
            return
        fi
    done
}

install_postgres() {
    [ "$(id -u)" = 0 ] || die "PostgreSQL 15 is not installed and installing it needs root (apt-get install postgresql-15)"
    command -v apt-get >/dev/null || die "PostgreSQL 15 is not installed and there is no apt-get"
    say "installing postgresql-15"
    # The Debian package would otherwise create and start a 'main' cluster on port 5432.
    mkdir -p /etc/postgresql-common
    if ! grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf; then
        echo 'create_main_cluster = false' >>/etc/postgresql-common/createcluster.conf
    fi
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15 >&2
}

bindir=$(find_bindir)
if [ -z "$bindir" ] && [ "$command" = start ]; then
    install_postgres
    bindir=$(find_bindir)
    [ -n "$bindir" ] || die "postgresql-15 installed but no initdb under /usr/lib/postgresql"
fi

# initdb and postgres refuse to run as root: as root the server belongs to the postgres user.
if [ "$(id -u)" = 0 ]; then
    pg_user=postgres
    id -u "$pg_user" >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash "$pg_user"
else
    pg_user=$(id -un)
fi

as_pg_user() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u "$pg_user" -- "$@"
    else
        "$@"
    fi
}

print_env() {
    cat <<EOF
export ORCA_RELAY_TEST_DATABASE_URL='postgres://postgres@127.0.0.1:$PG_PORT/postgres'
export ORCA_RELAY_TEST_PGDATA='$PG_DATA'
export ORCA_RELAY_TEST_PG_CTL='$PG_BINDIR/pg_ctl'
export ORCA_RELAY_TEST_PG_USER='$pg_user'
EOF
}

load_state() {
    [ -f "$state_file" ] || return 1
    # shellcheck disable=SC1090
    . "$state_file"
    [ -n "${PG_DATA:-}" ] && [ -n "${PG_PORT:-}" ] && [ -n "${PG_BINDIR:-}" ]
}

is_running() {
    [ -d "$PG_DATA" ] && as_pg_user "$PG_BINDIR/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1
}

port_is_free() {
    local port=$1
    if command -v ss >/dev/null; then
        [ -z "$(ss -Hltn "sport = :$port" 2>/dev/null)" ]
    else
        ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
    fi
}

pick_port() {
    local port tries
    for tries in $(seq 1 50); do
        port=$((20000 + RANDOM % 40000))
        if port_is_free "$port"; then
            echo "$port"
            return
        fi
    done
    die "no free port found"
}

wait_ready() {
    local i
    for i in $(seq 1 100); do
        if "$PG_BINDIR/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -U postgres; then
            return 0
        fi
        sleep 0.1
    done
    return 1
}

start() {
    if load_state; then
        if is_running && wait_ready; then
            print_env
            return
        fi
        if [ -d "$PG_DATA" ] && as_pg_user "$PG_BINDIR/pg_ctl" -D "$PG_DATA" -l "$PG_DATA/log/pg_ctl.log" -w -t 60 start >/dev/null 2>&1 && wait_ready; then
            say "restarted the server in $PG_DATA on port $PG_PORT"
            print_env
            return
        fi
        say "the recorded server in ${PG_DATA:-?} is gone; starting a new one"
        stop_quietly
    fi

    PG_BINDIR=$bindir
    PG_DATA=$(mktemp -d "${TMPDIR:-/tmp}/orca-relay-pg.XXXXXX")
    chmod 700 "$PG_DATA"
    if [ "$(id -u)" = 0 ]; then
        chown "$pg_user": "$PG_DATA"
    fi
    as_pg_user "$PG_BINDIR/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 --no-locale >"$PG_DATA.initdb.log" 2>&1 ||
        { cat "$PG_DATA.initdb.log" >&2; die "initdb failed"; }
    rm -f "$PG_DATA.initdb.log"

    local attempt
    for attempt in 1 2 3 4 5; do
        PG_PORT=$(pick_port)
        as_pg_user tee "$PG_DATA/orca-relay-test.conf" >/dev/null <<EOF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_DATA'
max_connections = 300
shared_buffers = 64MB
fsync = off
synchronous_commit = off
full_page_writes = off
logging_collector = on
log_directory = 'log'
log_filename = 'postgresql.log'
EOF
        if ! grep -q "^include_if_exists = 'orca-relay-test.conf'" "$PG_DATA/postgresql.conf"; then
            echo "include_if_exists = 'orca-relay-test.conf'" | as_pg_user tee -a "$PG_DATA/postgresql.conf" >/dev/null
        fi
        as_pg_user mkdir -p "$PG_DATA/log"
        if as_pg_user "$PG_BINDIR/pg_ctl" -D "$PG_DATA" -l "$PG_DATA/log/pg_ctl.log" -w -t 60 start >/dev/null 2>&1 && wait_ready; then
            mkdir -p "$(dirname "$state_file")"
            cat >"$state_file" <<EOF
PG_DATA='$PG_DATA'
PG_PORT='$PG_PORT'
PG_BINDIR='$PG_BINDIR'
EOF
            say "PostgreSQL $("$PG_BINDIR/postgres" --version | awk '{print $3}') on 127.0.0.1:$PG_PORT, data in $PG_DATA"
            print_env
            return
        fi
        say "start on port $PG_PORT failed (attempt $attempt); trying another port"
    done
    tail -n 20 "$PG_DATA/log/postgresql.log" >&2 2>/dev/null || true
    die "could not start PostgreSQL"
}

stop_quietly() {
    if [ -n "${PG_DATA:-}" ] && [ -d "$PG_DATA" ]; then
        as_pg_user "$PG_BINDIR/pg_ctl" -D "$PG_DATA" -w -t 60 stop -m fast >/dev/null 2>&1 || true
        case "$PG_DATA" in
            */orca-relay-pg.*) rm -rf "$PG_DATA" ;;
        esac
    fi
    rm -f "$state_file"
}

case "$command" in
    start)
        start
        ;;
    env)
        load_state && is_running || die "not running; use: eval \"\$(scripts/test-postgres.sh start)\""
        print_env
        ;;
    stop)
        if load_state; then
            stop_quietly
            say "stopped"
        else
            say "not running"
        fi
        ;;
    status)
        if load_state && is_running; then
            say "running on 127.0.0.1:$PG_PORT, data in $PG_DATA"
        else
            say "not running"
            exit 1
        fi
        ;;
    *)
        die "usage: $0 start|env|stop|status"
        ;;
esac
