#!/usr/bin/env bash
# `sam build` of infra/template.yaml for x86_64 (cargo-lambda from the twin's venv, SAM CLI from the
# infra venv), with build and cache directories outside the clone so repeated runs are incremental;
# then checks that every function's bootstrap is an x86-64 executable.
#   scripts/sam-build.sh              the release binaries (if not up to date), sam build, the check
#   scripts/sam-build.sh --binaries   only the release binaries (scripts/test.sh runs this in the background)
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
[ -x "$HOME_DIR/twinvenv/bin/cargo-lambda" ] || { python3 -m venv "$HOME_DIR/twinvenv"; "$HOME_DIR/twinvenv/bin/pip" install -q -r twin/requirements.txt; }
export PATH="$HOME_DIR/twinvenv/bin:$PATH" SAM_CLI_TELEMETRY=0
# A target directory of its own: a release build for another target shares no artifact with the debug
# builds the tests use, and a build of its own can run beside theirs (cargo locks a target directory).
export CARGO_TARGET_DIR=$HOME_DIR/lambda-target
BUILD=$HOME_DIR/sam-build
FUNCTIONS=(resolve describe plan warm maintain report capture)
# The seven binaries in one cargo-lambda build first: `sam build` runs one build per function, one
# after another; one build compiles them side by side (the release profile: Cargo.toml). `sam build`
# then finds them up to date (same flags, same target directory) and only copies them.
bins=(); for b in "${FUNCTIONS[@]}"; do bins+=(--bin "$b"); done
started=$(date +%s)
cargo lambda build --release "${bins[@]}" >"$HOME_DIR/cargo-lambda-build.log" 2>&1 \
  || { tail -40 "$HOME_DIR/cargo-lambda-build.log"; exit 1; }
echo "cargo lambda build: ${#FUNCTIONS[@]} binaries in $(( $(date +%s) - started )) s"
[ "${1:-}" = --binaries ] && exit 0
[ -x "$HOME_DIR/venv/bin/sam" ] || bash scripts/check-infra.sh >/dev/null   # installs the pinned SAM CLI
started=$(date +%s)
"$HOME_DIR/venv/bin/sam" build --parameter-overrides Architecture=x86_64 \
  --build-dir "$BUILD" --cache-dir "$HOME_DIR/sam-cache" >"$HOME_DIR/sam-build.log" 2>&1 \
  || { tail -40 "$HOME_DIR/sam-build.log"; exit 1; }
echo "sam build: $(( $(date +%s) - started )) s"
count=0
for fn in Resolve Describe Plan Warm Maintain Report Capture; do
  f="$BUILD/${fn}Function/bootstrap"
  file -b "$f" | grep -q "ELF 64-bit LSB .*x86-64" || { echo "sam build: $f is not an x86-64 executable"; exit 1; }
  count=$((count + 1))
done
echo "✓ sam build: $count bootstrap binaries (x86_64) in $BUILD"
