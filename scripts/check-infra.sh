#!/usr/bin/env bash
# Validates the deployable definitions offline: the state machine with asl-validator (npm) and the SAM
# template with cfn-lint and `sam validate --lint` (PyPI, in a venv). All pinned, installed here on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${PGHYDRATE_HOME:-/var/tmp/pghydrate}
NODE_DIR=$HOME_DIR/node
VENV=$HOME_DIR/venv
ASL_VALIDATOR=4.0.0
CFN_LINT=1.58.0
SAM_CLI=1.170.0

if [ ! -x "$NODE_DIR/node_modules/.bin/asl-validator" ] || ! grep -q "\"version\": \"$ASL_VALIDATOR\"" "$NODE_DIR/node_modules/asl-validator/package.json" 2>/dev/null; then
  mkdir -p "$NODE_DIR"
  (cd "$NODE_DIR" && { [ -f package.json ] || npm init -y >/dev/null; } && npm install --no-audit --no-fund --silent "asl-validator@$ASL_VALIDATOR")
fi
if [ ! -x "$VENV/bin/cfn-lint" ] || [ "$("$VENV/bin/cfn-lint" --version 2>/dev/null | awk '{print $2}')" != "$CFN_LINT" ] \
   || [ "$("$VENV/bin/sam" --version 2>/dev/null | awk '{print $4}')" != "$SAM_CLI" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "cfn-lint==$CFN_LINT" "aws-sam-cli==$SAM_CLI"
fi

status=0
for asl in statemachine/*.asl.json docs/examples/*.asl.json; do
  "$NODE_DIR/node_modules/.bin/asl-validator" --json-path "$asl" || status=1
done
"$VENV/bin/cfn-lint" infra/template.yaml && echo "✓ infra/template.yaml passes cfn-lint $CFN_LINT" || status=1
# sam validate --lint reads samconfig.toml; it needs a region but no credentials.
SAM_CLI_TELEMETRY=0 "$VENV/bin/sam" validate --lint --region us-east-1 || status=1
exit $status
