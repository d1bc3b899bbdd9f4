#!/usr/bin/env bash
# `make test`: every test, each phase timed (the table at the end), then the tally line.
#   infra checks -> debug build (binaries and test binaries) -> the Rust suites (cargo test) and the
#   twin (pytest) side by side -> sam build
# The Rust suites and the twin mostly wait on servers, on a slow volume or on the Step Functions
# interpreter, so they run at the same time: the Rust suites in the background (their output in
# $PGHYDRATE_HOME/test.log, its failures printed at the end), the twin in the foreground. They share
# nothing but the machine: each starts its own servers on free ports, under directories of its own.
# The Lambda functions' release build for `sam build` runs in the background too, at the lowest CPU
# priority (its session's autogroup too); it is awaited before `sam build`, and stopped if this script
# ends first. The tests' outcomes do not depend on the CPU they get (the twin suite and the hot-set tests pass with both cores
# busy), and their durations are printed (cargo test's per binary, pytest's slowest 15).
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME_DIR/target}
CARGO=${CARGO:-cargo}
timings=()
timed() {  # timed NAME SECONDS: a line of the table
  timings+=("$(printf '%-36s %6d s' "$1" "$2")")
}
phase() {  # phase NAME COMMAND...: runs it, records its wall time, returns its status
  local name=$1 started=$SECONDS status=0
  shift
  "$@" || status=$?
  timed "$name" $((SECONDS - started))
  return $status
}
summary() {  # the table, then the tally of both suites
  echo
  echo "make test, wall time of each phase:"
  printf '  %s\n' "${timings[@]}"
  awk '/^test result:/ { p += $4; f += $6 }
       FILENAME ~ /e2e.log$/ && / passed/ && /in [0-9.]+s/ {
         for (i = 1; i < NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
       END { printf "%d passed, %d failed\n", p, f }' "$HOME_DIR/test.log" "$HOME_DIR/e2e.log"
}

lambda_build="" rust_suites=""
stop_background() {
  [ -n "$lambda_build" ] && kill -TERM -- "-$lambda_build" 2>/dev/null || true
  [ -n "$rust_suites" ] && kill -TERM -- "-$rust_suites" 2>/dev/null || true
}
trap stop_background EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

phase "infra checks" bash scripts/check-infra.sh
phase "twin tooling (venv)" bash twin/up.sh --venv  # before the background build, which needs its cargo-lambda
# Every test binary too: the twin's Lambdas run through `cargo run`, which would wait for the build
# directory while cargo test compiled beside it.
phase "debug build" bash -c "$CARGO build --locked --workspace && $CARGO test --locked --workspace --no-run"
# Its own session (so the whole build can be stopped), its own target directory (scripts/sam-build.sh).
# Lowest priority as the scheduler sees it: with autogroups (Debian's kernels), a new session is a group
# of its own that shares the CPU equally with the twin's whatever its nice value, so the session's own
# nice is set too (/proc/self/autogroup). Measured: the distributed map test took 52 s alone, 220 s beside
# two busy loops at nice 19 in a session of their own, 75 s when that session's autogroup nice was 19.
setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || true; exec nice -n 19 "$@"' low-priority \
  bash scripts/sam-build.sh --binaries >"$HOME_DIR/lambda-build.out" 2>&1 &
lambda_build=$!
started_lambda=$SECONDS
rm -f "$HOME_DIR/test.end"
# In a session of its own too, so that stopping it stops the test binaries and their servers.
setsid bash -c 'status=0; "$0" test --workspace --locked --no-fail-fast >"$1/test.log" 2>&1 || status=$?
  echo "$status $(date +%s)" >"$1/test.end"; exit $status' "$CARGO" "$HOME_DIR" &
rust_suites=$!
rust_started_at=$(date +%s)
twin_status=0
phase "twin (pytest)" bash -c "set -o pipefail; bash twin/up.sh 2>&1 | tee $HOME_DIR/e2e.log" || twin_status=$?
rust_status=0
wait "$rust_suites" || rust_status=$?
rust_suites=""
timed "Rust suites (cargo test, beside it)" $(( $(cut -d' ' -f2 "$HOME_DIR/test.end") - rust_started_at ))
echo "Rust suites, each test binary's time:"
grep -E "^ +Running|^test result:" "$HOME_DIR/test.log" | paste - - \
  | sed -E 's/.*\/deps\/([A-Za-z_]+)-[0-9a-f]+\).*; finished in ([0-9.]+)s.*/  \1 \2 s/' || true
if [ "$rust_status" -ne 0 ] || [ "$twin_status" -ne 0 ]; then
  sed -n '/^failures:$/,/^test result: FAILED/p' "$HOME_DIR/test.log" | tail -200
  summary
  echo "make test: the Rust suites exited $rust_status, the twin $twin_status (logs: $HOME_DIR/test.log, $HOME_DIR/e2e.log)"
  exit 1
fi
started=$SECONDS
if ! wait "$lambda_build"; then
  cat "$HOME_DIR/lambda-build.out"; lambda_build=""; exit 1
fi
lambda_build=""
timed "release build (background)" $((SECONDS - started_lambda))
timed "  waited for after the tests" $((SECONDS - started))
cat "$HOME_DIR/lambda-build.out"
phase "sam build" bash scripts/sam-build.sh
summary
