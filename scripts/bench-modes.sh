#!/usr/bin/env bash
# Measures pg_prewarm modes and range sizes through pghydrate, to back `--mode auto` and the default
# --range-blocks (results: docs/tuning.md). Needs root.
#
# Storage model: the cluster lives on a loop device whose reads are capped at $IOPS requests per second
# (cgroup v1 blkio throttle), and PostgreSQL reads with O_DIRECT (debug_io_direct = data, 16+), so
# neither the page cache nor the host's cache hides the cost of a request: what differs between modes
# is how many requests they issue and how many are in flight. This is a model of a request-bound
# volume, not a lazy-loading simulator. PostgreSQL 15 has no direct I/O; its read and buffer modes
# issue the same single-block reads as 16's.
#
# Usage: sudo bash scripts/bench-modes.sh   (env: IOPS=2000 SCALE=6 REPS=3 VERSIONS="16 17 18")
set -euo pipefail
IOPS=${IOPS:-2000}
SCALE=${SCALE:-6}
REPS=${REPS:-3}
VERSIONS=${VERSIONS:-16 17 18}
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
BIN=${PGHYDRATE_BIN:-${CARGO_TARGET_DIR:-$HOME_DIR/target}/release/pghydrate}
B=$HOME_DIR/bench
CG=/sys/fs/cgroup/blkio/pghydrate-bench
PW=bench-pw
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-modes: needs root (loop device, cgroup)"; exit 1; }
[ -x "$BIN" ] || { echo "bench-modes: build first: cargo build --release -p pghydrate-cli"; exit 1; }

cleanup() {
  for v in $VERSIONS; do
    [ -d "$B/mnt/pg$v" ] && runuser -u pghydrate -- "$HOME_DIR/pg/$v/bin/pg_ctl" -D "$B/mnt/pg$v" -m immediate stop >/dev/null 2>&1 || true
  done
  mountpoint -q "$B/mnt" && umount "$B/mnt"
  [ -n "${LOOP:-}" ] && losetup -d "$LOOP" 2>/dev/null || true
  rm -f "$B/disk.img"
  [ -d "$CG" ] && rmdir "$CG" 2>/dev/null || true
}
trap cleanup EXIT

mkdir -p "$B/mnt" "$B/results"
rm -f "$B/disk.img"; truncate -s 4G "$B/disk.img"; mkfs.ext4 -q "$B/disk.img"
LOOP=$(losetup --direct-io=on -f --show "$B/disk.img")
mount "$LOOP" "$B/mnt"; chown pghydrate "$B/mnt"
mkdir -p "$CG"
MAJMIN=$(lsblk -no MAJ:MIN "$LOOP" | tr -d ' ')

start_pg() {  # starts the server from inside the throttled cgroup: every backend inherits it
  local v=$1 port=$2 throttle=$3
  echo "$MAJMIN $throttle" > "$CG/blkio.throttle.read_iops_device"
  ( echo $BASHPID > "$CG/cgroup.procs"
    runuser -u pghydrate -- "$HOME_DIR/pg/$v/bin/pg_ctl" -D "$B/mnt/pg$v" -l "$B/mnt/pg$v.log" -o "-p $port" -w start >/dev/null )
}
stop_pg() { runuser -u pghydrate -- "$HOME_DIR/pg/$1/bin/pg_ctl" -D "$B/mnt/pg$1" -m fast -w stop >/dev/null; }

out=$B/results/modes-$(date +%Y%m%dT%H%M%S).tsv
echo -e "version\tstorage\tmode\tsessions\trange_blocks\trep\tbytes\tseconds\tMiB_per_s" > "$out"
measure() {  # version port throttle mode sessions range_blocks rep
  local v=$1 port=$2 thr=$3 mode=$4 s=$5 rb=$6 rep=$7
  stop_pg "$v"; sync; echo 3 > /proc/sys/vm/drop_caches; start_pg "$v" "$port" "$thr"
  PGPASSWORD=$PW "$BIN" run "postgresql://postgres@127.0.0.1:$port/postgres" --tls disable -q --progress none \
    --include-database bench --maintenance none --mode "$mode" --sessions "$s" --range-blocks "$rb" \
    --report "$B/r.json" >/dev/null
  python3 - "$B/r.json" "$v" "$thr" "$mode" "$s" "$rb" "$rep" >> "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
v, thr, mode, s, rb, rep = sys.argv[2:]
assert r["coverage"] == 1.0, r["status"]
sec = r["timings"]["warm_seconds"]
storage = "hot" if thr == "0" else f"{thr} IOPS"
print(f"{v}\t{storage}\t{mode}\t{s}\t{rb}\t{rep}\t{r['warmed_bytes']}\t{sec:.3f}\t{r['warmed_bytes']/sec/1048576:.1f}")
PY
  tail -n1 "$out" >&2
}

port=57400
for v in $VERSIONS; do
  port=$((port + 1))
  echo "$PW" > "$B/pw"; chown pghydrate "$B/pw"
  runuser -u pghydrate -- "$HOME_DIR/pg/$v/bin/initdb" -D "$B/mnt/pg$v" -U postgres -A scram-sha-256 \
    --auth-local=trust --pwfile="$B/pw" -E UTF8 --locale=C >/dev/null
  cat >> "$B/mnt/pg$v/postgresql.auto.conf" <<CONF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$B/mnt'
shared_buffers = 256MB
debug_io_direct = data
CONF
  start_pg "$v" "$port" 0
  PGPASSWORD=$PW psql -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -c 'CREATE DATABASE bench'
  PGPASSWORD=$PW PGOPTIONS="-c pghydrate.scale=$SCALE" psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" \
    -U postgres -d bench -f scripts/sample.sql >/dev/null
  PGPASSWORD=$PW psql -X -q -h 127.0.0.1 -p "$port" -U postgres -d bench -c 'VACUUM ANALYZE'
  for rep in $(seq "$REPS"); do
    for mode in read buffer; do
      for s in 1 4; do measure "$v" "$port" "$IOPS" "$mode" "$s" 8192 "$rep"; done
    done
    # Range size: per-call overhead with nothing to wait for (shared_buffers evicted by restart, data
    # read with direct I/O from an unthrottled device), and under the request cap.
    for rb in 16 128 1024 8192 65536; do measure "$v" "$port" 0 buffer 4 "$rb" "$rep"; done
    for rb in 128 8192; do measure "$v" "$port" "$IOPS" buffer 4 "$rb" "$rep"; done
  done
  stop_pg "$v"
done

echo "raw results: $out"
python3 - "$out" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
groups = {}
for r in rows:
    k = (r["version"], r["storage"], r["mode"], r["sessions"], r["range_blocks"])
    groups.setdefault(k, []).append(float(r["seconds"]))
mib = {k: int(r["bytes"]) / 1048576 for r in rows for k in [(r["version"], r["storage"], r["mode"], r["sessions"], r["range_blocks"])]}
print("| PostgreSQL | storage | mode | sessions | range blocks | MiB | median s | MiB/s | runs |")
print("|---|---|---|---|---|---|---|---|---|")
for k in sorted(groups):
    med = statistics.median(groups[k])
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {mib[k]:.0f} | {med:.2f} | {mib[k]/med:.1f} | {len(groups[k])} |")
PY
