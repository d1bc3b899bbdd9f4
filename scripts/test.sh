#!/usr/bin/env bash
# `make test`: every test, each phase timed (the table at the end), then the tally line.
#   infra checks -> debug build -> Rust suites (cargo test) -> the twin (pytest) -> sam build
# The Lambda functions' release build for `sam build` (cargo-lambda's one-codegen-unit LTO profile: about
# 15 minutes of CPU cold on 2 cores) runs in the background at the lowest CPU priority while the tests
# run, which mostly wait on servers; it is awaited before `sam build`, and stopped if this script ends
# first. The tests' outcomes do not depend on the CPU they get (the twin suite passes with both cores
# busy), and their durations are printed (cargo test's per binary, pytest's slowest 15).
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME_DIR/target}
CARGO=${CARGO:-cargo}
timings=()
phase() {  # phase NAME COMMAND...: runs it, records its wall time
  local name=$1 started=$SECONDS
  shift
  "$@"
  timings+=("$(printf '%-34s %6d s' "$name" $((SECONDS - started)))")
}

lambda_build=""
stop_lambda_build() {
  [ -n "$lambda_build" ] && kill -TERM -- "-$lambda_build" 2>/dev/null || true
}
trap stop_lambda_build EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

phase "infra checks" bash scripts/check-infra.sh
phase "twin tooling (venv)" bash twin/up.sh --venv  # before the background build, which needs its cargo-lambda
phase "debug build" "$CARGO" build --locked --workspace
# Its own session (so the whole build can be stopped), its own target directory (scripts/sam-build.sh).
setsid nice -n 19 bash scripts/sam-build.sh --binaries >"$HOME_DIR/lambda-build.out" 2>&1 &
lambda_build=$!
started_lambda=$SECONDS
phase "Rust suites (cargo test)" bash -c "set -o pipefail; $CARGO test --workspace --locked 2>&1 | tee $HOME_DIR/test.log"
phase "twin (pytest)" bash -c "set -o pipefail; bash twin/up.sh 2>&1 | tee $HOME_DIR/e2e.log"
started=$SECONDS
if ! wait "$lambda_build"; then
  cat "$HOME_DIR/lambda-build.out"; lambda_build=""; exit 1
fi
lambda_build=""
timings+=("$(printf '%-34s %6d s' "release build (background)" $((SECONDS - started_lambda)))")
timings+=("$(printf '%-34s %6d s' "  waited for after the tests" $((SECONDS - started)))")
cat "$HOME_DIR/lambda-build.out"
phase "sam build" bash scripts/sam-build.sh
echo
echo "make test, wall time of each phase:"
printf '  %s\n' "${timings[@]}"
awk '/^test result:/ { p += $4; f += $6 }
     FILENAME ~ /e2e.log$/ && / passed/ && /in [0-9.]+s/ {
       for (i = 1; i < NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "%d passed, %d failed\n", p, f }' "$HOME_DIR/test.log" "$HOME_DIR/e2e.log"
