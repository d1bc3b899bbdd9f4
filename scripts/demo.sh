#!/usr/bin/env bash
# The main job on an embedded default: a local PostgreSQL 15 cluster with a generated sample database
# (TOAST, several index kinds, partitions, a materialized view, an unlogged table, odd identifiers),
# made cold, then hydrated by `pghydrate run`.
#
# Where FUSE can be mounted (root, /dev/fuse), the sample database lives on the lazy-volume simulator
# (sim/, pghydrate-lazyvol): each first read of a 512 KiB chunk waits PGHYDRATE_DEMO_LATENCY (20ms), at most
# PGHYDRATE_DEMO_QUEUE (4) at once, as a volume restored from a snapshot does. The demo then shows the
# problem and the cure: a representative query (100 customers by primary key with their documents) timed
# on the cold volume, the hydration, and the same query after, from a restarted server and an emptied page
# cache, so that only the volume differs. Elsewhere (or with PGHYDRATE_DEMO_LAZY=0) it says so and
# runs on a plain directory, made cold by evicting its files from the page cache.
#
# The cluster is kept in $PGHYDRATE_HOME/demo between runs (make clean-demo removes it) and stopped
# at the end. Extra arguments go to `pghydrate run` (e.g. --sessions 4 --mode read).
set -euo pipefail
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
DEMO=$HOME_DIR/demo
TARGET=${CARGO_TARGET_DIR:-$HOME_DIR/target}
BIN=${PGHYDRATE_BIN:-$TARGET/release/pghydrate}
LAZYVOL=${PGHYDRATE_LAZYVOL_BIN:-$TARGET/release/pghydrate-lazyvol}
PGBIN=${PGHYDRATE_DEMO_PGBIN:-$HOME_DIR/pg/15/bin}
SCALE=${PGHYDRATE_DEMO_SCALE:-25}
LATENCY=${PGHYDRATE_DEMO_LATENCY:-20ms}
QUEUE=${PGHYDRATE_DEMO_QUEUE:-4}
PASSWORD=demo-password
RUN_AS=pghydrate
cd "$(dirname "$0")/.."
ROOT=$PWD

as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u "$RUN_AS" -- "$@"; else "$@"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
psql_() { PGPASSWORD=$PASSWORD "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres "$@"; }
start() { as_pg "$PGBIN/pg_ctl" -D "$DEMO/data" -l "$DEMO/log" -o "-p $PORT" -w start >/dev/null; }
stop() { as_pg "$PGBIN/pg_ctl" -D "$DEMO/data" -m fast -w stop >/dev/null 2>&1 || true; }
residency() {  # share of each database's data files in the OS page cache
  psql_ -d postgres -At -F ' ' -c "SELECT oid, datname FROM pg_database ORDER BY oid" | while read -r oid name; do
    printf '%s' " $name $(python3 "$ROOT/scripts/pagecache.py" residency "$DEMO/data/base/$oid"),"
  done
  printf ' shared catalogs %s\n' "$(python3 "$ROOT/scripts/pagecache.py" residency "$DEMO/data/global")"
}

# The lazy volume: the simulator serves $DEMO/volume-backing at $DEMO/volume, every chunk cold when mounted.
VOLUME=$DEMO/volume
mounted() { grep -q " $VOLUME fuse" /proc/mounts; }
unmount() {
  if [ -f "$DEMO/volume.pid" ]; then kill "$(cat "$DEMO/volume.pid")" 2>/dev/null || true; rm -f "$DEMO/volume.pid"; fi
  for _ in $(seq 50); do mounted || break; sleep 0.1; done
  if mounted; then umount -l "$VOLUME" 2>/dev/null || true; fi
}
mount_volume() {  # latency; returns non-zero (and logs) if the simulator cannot mount
  unmount
  rm -f "$DEMO/volume-status.json"
  "$LAZYVOL" "$DEMO/volume-backing" "$VOLUME" --status "$DEMO/volume-status.json" --latency "$1" \
    --concurrency "$QUEUE" >> "$DEMO/volume.log" 2>&1 &
  echo $! > "$DEMO/volume.pid"
  for _ in $(seq 300); do
    if mounted && [ -f "$DEMO/volume-status.json" ]; then return 0; fi
    kill -0 "$(cat "$DEMO/volume.pid")" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
hydrated() { python3 -c 'import json, sys; print(format(json.load(open(sys.argv[1]))["hydrated"], ".1%"))' "$DEMO/volume-status.json"; }
# The representative query: 100 customers by primary key, each with a TOASTed document (index lookups
# spread over the database, as an application's first requests after a restore are).
QUERY="SELECT count(*), sum(length(d.body)) FROM customers c JOIN documents d ON d.id = c.id % (500 * $SCALE) + 1
        WHERE c.id IN (SELECT (g * 7919) % (20000 * $SCALE) + 1 FROM generate_series(1, 100) g)"
timed_query() {  # prints the query's milliseconds (a new connection: its catalog reads are not counted)
  psql_ -d shop -At -c '\timing on' -c "$QUERY" | sed -n 's/^Time: \([0-9.]*\) ms.*/\1/p'
}
restart_cold() {  # restart PostgreSQL (empty shared buffers) and evict the cluster's files from the page cache
  stop
  [ "$LAZY" = 1 ] && { mount_volume "$1" || { echo "demo: the lazy volume did not mount: $(tail -3 "$DEMO/volume.log")" >&2; exit 1; }; }
  start
  python3 scripts/pagecache.py evict "$DEMO/data/base" "$DEMO/data/global"
}

LAZY=0
why=""
if [ "${PGHYDRATE_DEMO_LAZY:-1}" = 0 ]; then why="PGHYDRATE_DEMO_LAZY=0"
elif [ "$(id -u)" != 0 ]; then why="mounting FUSE needs root"
elif [ ! -e /dev/fuse ]; then why="no /dev/fuse on this machine"
elif [ ! -x "$LAZYVOL" ]; then why="no simulator binary at $LAZYVOL (cargo build --release -p pghydrate-lazyvol)"
else LAZY=1
fi
mkdir -p "$DEMO"
[ "$(id -u)" = 0 ] && chown "$RUN_AS" "$DEMO"
PORT=$(free_port)
trap 'stop; if [ "$LAZY" = 1 ]; then unmount; fi' EXIT

MODE=$([ "$LAZY" = 1 ] && echo lazy || echo plain)
if [ ! -f "$DEMO/ready-$MODE" ]; then
  echo "demo: creating a PostgreSQL 15 cluster in $DEMO/data"
  stop; unmount
  rm -rf "$DEMO/data" "$DEMO/volume-backing" "$DEMO"/ready*
  echo "$PASSWORD" > "$DEMO/pw"; [ "$(id -u)" = 0 ] && chown "$RUN_AS" "$DEMO/pw"
  as_pg "$PGBIN/initdb" -D "$DEMO/data" -U postgres -A scram-sha-256 --auth-local=trust --pwfile="$DEMO/pw" -E UTF8 --locale=C >/dev/null
  cat >> "$DEMO/data/postgresql.auto.conf" <<CONF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DEMO'
shared_buffers = 128MB
CONF
  WHERE=""
  if [ "$LAZY" = 1 ]; then
    mkdir -p "$DEMO/volume-backing" "$VOLUME"
    chown "$RUN_AS" "$DEMO/volume-backing" "$VOLUME"
    mount_volume 0ms || { echo "demo: the lazy volume did not mount: $(tail -3 "$DEMO/volume.log")" >&2; exit 1; }
    WHERE=" TABLESPACE lazy"
  fi
  start
  [ "$LAZY" = 1 ] && psql_ -d postgres -c "CREATE TABLESPACE lazy LOCATION '$VOLUME'"
  echo "demo: generating the sample database 'shop' (scale $SCALE, about $((SCALE * 12)) MiB)"
  psql_ -d postgres -c "CREATE DATABASE shop$WHERE"
  PGOPTIONS="-c pghydrate.scale=$SCALE" psql_ -d shop -f scripts/sample.sql
  psql_ -d shop -c 'VACUUM ANALYZE'
  psql_ -d postgres -c 'CHECKPOINT'
  touch "$DEMO/ready-$MODE"
fi

if [ "$LAZY" = 1 ]; then
  echo "demo: restoring from a snapshot, simulated: database 'shop' on a lazy volume (sim/), every 512 KiB chunk"
  echo "      cold until first read, $LATENCY per fetch, $QUEUE at once; PostgreSQL restarted, page cache emptied"
  restart_cold "$LATENCY"
  cold_ms=$(timed_query)
  echo "demo: the representative query (100 customers with their documents) on the cold volume: $cold_ms ms"
  echo "      (volume hydrated $(hydrated) after it)"
else
  echo "demo: the lazy-volume simulator is not used here: $why; the demo runs on a plain directory"
  echo "demo: making it cold: restarting PostgreSQL (empty shared_buffers) and evicting its files from the page cache"
  restart_cold ""
  echo "demo: page cache residency before:$(residency)"
fi
echo "demo: running: pghydrate run postgresql://postgres:***@127.0.0.1:$PORT/postgres --tls disable --report $DEMO/report.json $*"
set +e
# The demo server has no TLS: connecting unencrypted is an explicit choice (and logs a warning).
PGPASSWORD=$PASSWORD "$BIN" run "postgresql://postgres@127.0.0.1:$PORT/postgres" --tls disable --report "$DEMO/report.json" "$@"
code=$?
set -e
if [ "$LAZY" = 1 ]; then
  echo "demo: volume hydrated $(hydrated) after pghydrate"
  # Same query from a restarted server and an emptied page cache: only the volume differs from before.
  stop; start
  python3 scripts/pagecache.py evict "$DEMO/data/base" "$DEMO/data/global" "$VOLUME"
  after_ms=$(timed_query)
  echo "demo: the same query after hydration (PostgreSQL restarted, page cache emptied): $after_ms ms" \
       "(cold it took $cold_ms ms, $(python3 -c "print(f'{$cold_ms / max($after_ms, 0.001):.0f}x')") as long)"
else
  echo "demo: page cache residency after:$(residency) (templates are not hydrated: nobody connects to them)"
fi
echo "demo: full JSON report: $DEMO/report.json (exit code $code)"
exit $code
