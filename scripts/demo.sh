#!/usr/bin/env bash
# The main job on an embedded default: a local PostgreSQL 15 cluster with a generated sample database
# (TOAST, several index kinds, partitions, a materialized view, an unlogged table, odd identifiers),
# made cold (server restarted, its files evicted from the page cache), then hydrated by `pghydrate run`.
# The cluster is kept in $PGHYDRATE_HOME/demo between runs (make clean-demo removes it) and stopped
# at the end. Extra arguments go to `pghydrate run` (e.g. --sessions 4 --mode read).
set -euo pipefail
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
DEMO=$HOME_DIR/demo
BIN=${PGHYDRATE_BIN:-${CARGO_TARGET_DIR:-$HOME_DIR/target}/release/pghydrate}
PGBIN=${PGHYDRATE_DEMO_PGBIN:-$HOME_DIR/pg/15/bin}
SCALE=${PGHYDRATE_DEMO_SCALE:-25}
PASSWORD=demo-password
RUN_AS=pghydrate
cd "$(dirname "$0")/.."
ROOT=$PWD

as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u "$RUN_AS" -- "$@"; else "$@"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
psql_() { PGPASSWORD=$PASSWORD "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres "$@"; }
stop() { as_pg "$PGBIN/pg_ctl" -D "$DEMO/data" -m fast -w stop >/dev/null 2>&1 || true; }
residency() {  # share of each database's data files in the OS page cache
  psql_ -d postgres -At -F ' ' -c "SELECT oid, datname FROM pg_database ORDER BY oid" | while read -r oid name; do
    printf '%s' " $name $(python3 "$ROOT/scripts/pagecache.py" residency "$DEMO/data/base/$oid"),"
  done
  printf ' shared catalogs %s\n' "$(python3 "$ROOT/scripts/pagecache.py" residency "$DEMO/data/global")"
}

mkdir -p "$DEMO"
[ "$(id -u)" = 0 ] && chown "$RUN_AS" "$DEMO"
PORT=$(free_port)
trap stop EXIT

if [ ! -f "$DEMO/ready" ]; then
  echo "demo: creating a PostgreSQL 15 cluster in $DEMO/data"
  rm -rf "$DEMO/data"
  echo "$PASSWORD" > "$DEMO/pw"; [ "$(id -u)" = 0 ] && chown "$RUN_AS" "$DEMO/pw"
  as_pg "$PGBIN/initdb" -D "$DEMO/data" -U postgres -A scram-sha-256 --auth-local=trust --pwfile="$DEMO/pw" -E UTF8 --locale=C >/dev/null
  cat >> "$DEMO/data/postgresql.auto.conf" <<CONF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DEMO'
shared_buffers = 128MB
CONF
  as_pg "$PGBIN/pg_ctl" -D "$DEMO/data" -l "$DEMO/log" -o "-p $PORT" -w start >/dev/null
  echo "demo: generating the sample database 'shop' (scale $SCALE, about $((SCALE * 12)) MiB)"
  psql_ -d postgres -c 'CREATE DATABASE shop'
  PGOPTIONS="-c pghydrate.scale=$SCALE" psql_ -d shop -f scripts/sample.sql
  psql_ -d shop -c 'VACUUM ANALYZE'
  touch "$DEMO/ready"
  stop
fi

echo "demo: making it cold: restarting PostgreSQL (empty shared_buffers) and evicting its files from the page cache"
as_pg "$PGBIN/pg_ctl" -D "$DEMO/data" -l "$DEMO/log" -o "-p $PORT" -w start >/dev/null
python3 scripts/pagecache.py evict "$DEMO/data/base" "$DEMO/data/global"
echo "demo: page cache residency before:$(residency)"
echo "demo: running: pghydrate run postgresql://postgres:***@127.0.0.1:$PORT/postgres --tls disable --report $DEMO/report.json $*"
set +e
# The demo server has no TLS: connecting unencrypted is an explicit choice (and logs a warning).
PGPASSWORD=$PASSWORD "$BIN" run "postgresql://postgres@127.0.0.1:$PORT/postgres" --tls disable --report "$DEMO/report.json" "$@"
code=$?
set -e
echo "demo: page cache residency after:$(residency) (templates are not hydrated: nobody connects to them)"
echo "demo: full JSON report: $DEMO/report.json (exit code $code)"
exit $code
