#!/bin/sh
# Builds the orca-relay .deb with cargo-deb (metadata: [package.metadata.deb] in Cargo.toml).
# Installs cargo-deb first if it is missing. Prints the path of the package it built.
#
# Usage: packaging/build-deb.sh [extra cargo-deb arguments]
set -eu

cd "$(dirname "$0")/.."

if ! cargo deb --version >/dev/null 2>&1; then
    echo "build_deb_installing_cargo_deb" >&2
    cargo install cargo-deb --locked
fi

# The sql/ migrations are packaged to /usr/share/orca-relay/sql; refuse to build a package that
# would ship without them.
if ! ls sql/postgres/*.sql sql/sqlite/*.sql >/dev/null 2>&1; then
    echo "build_deb_failed reason=no_sql_migrations dir=sql/" >&2
    exit 1
fi

# cargo-deb runs `cargo build --release` itself; the path of the .deb is its last line.
deb=$(cargo deb "$@" | tail -n 1)
echo "$deb"
