#!/usr/bin/env bash
# Installs the twin's tooling (pinned, twin/requirements.txt) into $PGHYDRATE_HOME/twinvenv, builds the
# Lambda binaries, and runs the end-to-end scenarios (`make e2e`). Extra arguments go to pytest.
#   twin/up.sh --up     brings the twin up in the background and prints how to use it (`make twin-up`)
#   twin/up.sh --down   stops it (`make twin-down`)
#   twin/up.sh --venv   only installs the tooling (`make bench` uses its Python)
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
VENV=$HOME_DIR/twinvenv
if ! "$VENV/bin/python" -c "import moto, pytest; assert moto.__version__ == '5.2.5'" 2>/dev/null \
   || [ ! -x "$VENV/bin/cargo-lambda" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r twin/requirements.txt
fi
[ "${1:-}" = --venv ] && exit 0
[ "${1:-}" = --down ] && exec "$VENV/bin/python" twin/session.py down
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME_DIR/target}
cargo build --locked --workspace
cd twin
STATE=$HOME_DIR/twin-up
if [ "${1:-}" = --up ]; then
  [ -e "$STATE/ready" ] && { cat "$STATE/commands"; exit 0; }
  mkdir -p "$STATE"
  setsid nohup "$VENV/bin/python" session.py up >"$STATE/session.log" 2>&1 < /dev/null &
  for _ in $(seq 300); do
    [ -e "$STATE/ready" ] && { cat "$STATE/commands"; exit 0; }
    kill -0 $! 2>/dev/null || { cat "$STATE/session.log"; exit 1; }
    sleep 1
  done
  echo "the twin did not come up in 300 s; see $STATE/session.log"; exit 1
fi
exec "$VENV/bin/python" -m pytest -q -rs --durations=15 -p no:cacheprovider test_template.py test_iam.py test_lazyvol.py test_strict.py test_scenarios.py test_slow_volume.py test_capture.py test_warm_calls.py test_scale.py test_tenants.py "$@"
