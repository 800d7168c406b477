#!/bin/sh
# Lists a built orca-relay .deb (dpkg-deb -c) and fails unless every expected file is in it
# with the expected mode. Also checks the conffiles and the maintainer scripts.
#
# Usage: packaging/check-deb.sh [path/to/orca-relay_*.deb]
# Without an argument it checks the newest target/debian/orca-relay_*.deb.
set -eu

cd "$(dirname "$0")/.."

deb=${1:-$(ls -t target/debian/orca-relay_*.deb 2>/dev/null | head -n 1)}
if [ -z "$deb" ] || [ ! -f "$deb" ]; then
    echo "check_deb_failed reason=no_package path=${deb:-target/debian/orca-relay_*.deb}" >&2
    exit 1
fi

listing=$(dpkg-deb -c "$deb")
echo "$listing"

failed=0
# expect MODE PATH: the listing has a line whose mode and path match.
expect() {
    if ! echo "$listing" | awk -v mode="$1" -v path="./$2" \
        '$1 == mode && $6 == path { found = 1 } END { exit !found }'; then
        echo "check_deb_missing path=/$2 mode=$1" >&2
        failed=1
    fi
}

expect -rwxr-xr-x usr/bin/orca-relay
expect -rw-r--r-- lib/systemd/system/orca-relay-cell.service
expect -rw-r--r-- lib/systemd/system/orca-relay-director.service
expect -rw-r--r-- lib/systemd/system/orca-relay-cell-ws.socket
expect -rw-r--r-- lib/systemd/system/orca-relay-cell-http.socket
expect -rw-r--r-- usr/lib/sysusers.d/orca-relay.conf
expect -rw------- etc/orca-relay/cell.env
expect -rw------- etc/orca-relay/director.env
expect -rw-r--r-- usr/share/doc/orca-relay/examples/cell.env
expect -rw-r--r-- usr/share/doc/orca-relay/examples/director.env
expect -rw-r--r-- usr/share/doc/orca-relay/examples/fleet-seed.json
expect -rw-r--r-- usr/share/doc/orca-relay/examples/fleet-seed.toml
expect -rw-r--r-- usr/share/doc/orca-relay/PROTOCOL.md
expect -rw-r--r-- usr/share/doc/orca-relay/OPERATIONS.md
expect -rw-r--r-- usr/share/doc/orca-relay/CONFIGURATION.md
expect -rw-r--r-- usr/share/doc/orca-relay/monitoring/orca-relay.rules.yml
expect -rw-r--r-- usr/share/doc/orca-relay/monitoring/orca-relay.rules.test.yml
expect -rw-r--r-- usr/share/doc/orca-relay/monitoring/orca-relay-dashboard.json

# Every migration in the tree is in the package.
sql_count=0
for migration in sql/postgres/*.sql sql/sqlite/*.sql; do
    [ -e "$migration" ] || continue
    sql_count=$((sql_count + 1))
    expect -rw-r--r-- "usr/share/orca-relay/$migration"
done
if [ "$sql_count" -eq 0 ]; then
    echo "check_deb_missing path=sql/<backend>/*.sql reason=no_migrations_in_tree" >&2
    failed=1
fi

control=$(mktemp -d)
trap 'rm -rf "$control"' EXIT
dpkg-deb -e "$deb" "$control"
for conffile in /etc/orca-relay/cell.env /etc/orca-relay/director.env; do
    if ! grep -qx "$conffile" "$control/conffiles" 2>/dev/null; then
        echo "check_deb_missing conffile=$conffile" >&2
        failed=1
    fi
done
for script in postinst prerm postrm; do
    if [ ! -x "$control/$script" ]; then
        echo "check_deb_missing maintainer_script=$script" >&2
        failed=1
    fi
done
if ! grep -q 'systemd-sysusers orca-relay.conf' "$control/postinst" 2>/dev/null; then
    echo "check_deb_missing reason=postinst_does_not_create_user" >&2
    failed=1
fi

if [ "$failed" -ne 0 ]; then
    echo "check_deb_failed package=$deb" >&2
    exit 1
fi
echo "check_deb_ok package=$deb"
