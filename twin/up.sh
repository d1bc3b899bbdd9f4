#!/usr/bin/env bash
# Installs the twin's tooling (pinned, twin/requirements.txt) into $PGHYDRATE_HOME/twinvenv, builds the
# Lambda binaries, and runs the end-to-end scenarios (`make e2e`). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
VENV=$HOME_DIR/twinvenv
if ! "$VENV/bin/python" -c "import moto, pytest; assert moto.__version__ == '5.2.5'" 2>/dev/null \
   || [ ! -x "$VENV/bin/cargo-lambda" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -r twin/requirements.txt
fi
cargo build --locked --workspace
cd twin
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider test_scenarios.py "$@"
